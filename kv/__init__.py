"""jaxsync.kv: sync-free paged KV block copy, pinned-host swap, slot inject/extract, save/load.

Pinned-host swap space comes in two layouts: per-layer caches like the device's (`copy_blocks`,
fastest device->host) and a block-major `HostPool` (`swap_out` / `swap_in`: one DMA per block for
all layers, and on GPUs a kernel reading the pinned pool directly, much faster host->device than
one DMA per block and layer).

Ports vLLM's `copy_kv_blocks` and the ExampleConnector's KV paths. Every entry
point validates its host metadata before dispatch, uploads ids in one transfer, pads counts to
buckets (one compiled program per bucket) and handles all layers of a cache in one jitted call.

Inside a server's own jitted step: `write_slots` / `read_slots` / `copy_pairs` are the entries'
bodies as pure functions of device ids, planned on the host by `plan_slots` / `plan_copy` (the
entries' validation and padding, as fields for the step's one `jaxsync.upload_packed`). Pass
them the uploaded plan: it records the cache geometry it was planned for, checked while tracing.

Files: `save_kv` / `load_kv` write and read vLLM's ExampleConnector layout by default
(`format="vllm"`: one "kv_cache" tensor per layer; files move between vLLM and jaxsync both
ways), or jaxsync's own (`format="jaxsync"`).

Padded tokens: a slot of -1 (vLLM's padding in `slot_mapping`) writes nothing and reads zeros in
every slot path; any other negative slot, or one past the cache, is refused on the host.

Quantized caches: an fp8 cache (`float8_e4m3fn` or `float8_e5m2`, vLLM's `kv_cache_dtype="fp8"`)
takes `KVScales` (k and v scales, float32 per tensor or per kv head, kept on the device) in
`write_slots` / `inject_kv` / `concat_and_cache_mla`, which quantize as vLLM does (float32
`x / scale`, saturated, cast to nearest even), and in `read_slots` / `extract_kv`, which
dequantize (`float32(q) * scale` in the compute dtype). Block copies, swaps and files move the
fp8 bytes unchanged. nvfp4 is not offered: vLLM's nvfp4 cache packs two e2m1 values per byte
with an fp8 scale per 16 values and a per-tensor scale, and needs Blackwell GPUs. JAX has the
`float4_e2m1fn` type for storage; a cache of it would be worth offering once JAX computes with a
native fp4 type on the hardware served, which is not established here.
"""

from jaxsync.kv._copy import copy_blocks as copy_blocks, copy_pairs as copy_pairs
from jaxsync.kv._copy_plan import Direction as Direction, plan_copy as plan_copy
from jaxsync.kv._geometry import PlanGeometryError as PlanGeometryError
from jaxsync.kv._layout import (
    Cache as Cache,
    KVLayout as KVLayout,
    StackedCache as StackedCache,
    stack_layers as stack_layers,
    unstack_layers as unstack_layers,
)
from jaxsync.kv._pool import (
    HostPool as HostPool,
    host_pool as host_pool,
    swap_in as swap_in,
    swap_out as swap_out,
)
from jaxsync.kv._quant import KVScales as KVScales
from jaxsync.kv._slot_plan import (
    plan_slots as plan_slots,
    row_sharding as row_sharding,
    slot_mapping_for as slot_mapping_for,
)
from jaxsync.kv._slots import (
    concat_and_cache_mla as concat_and_cache_mla,
    extract_kv as extract_kv,
    inject_kv as inject_kv,
    read_slots as read_slots,
    write_slots as write_slots,
)
from jaxsync.kv._storage import kv_folder as kv_folder, load_kv as load_kv, save_kv as save_kv
