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
entries' validation and padding, as fields for the step's one `jaxsync.upload_packed`).
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
from jaxsync.kv._slot_plan import (
    plan_slots as plan_slots,
    row_sharding as row_sharding,
    slot_mapping_for as slot_mapping_for,
)
from jaxsync.kv._slots import (
    extract_kv as extract_kv,
    inject_kv as inject_kv,
    read_slots as read_slots,
    write_slots as write_slots,
)
from jaxsync.kv._storage import kv_folder as kv_folder, load_kv as load_kv, save_kv as save_kv
