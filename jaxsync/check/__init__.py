"""The sync-freedom proof harness.

Static: `scan_jaxpr`, `scan_hlo`, `lower_for` (exports for another platform, e.g. TPU).
Runtime: `sync_guard`, `allow_sync`, `entry_point` (armed by the JAXSYNC_SYNC_CHECK environment
variable). Recompiles: `no_recompile`. Dispatch probe: `measure_blocking`. All of them:
`assert_sync_free`.
"""

from jaxsync.check._export import lower_for as lower_for
from jaxsync.check._guard import (
    ENV_VAR as ENV_VAR,
    SyncError as SyncError,
    SyncWarning as SyncWarning,
    allow_sync as allow_sync,
    entry_point as entry_point,
    env_mode as env_mode,
    guard_active as guard_active,
    sync_guard as sync_guard,
)
from jaxsync.check._probe import (
    BlockingReport as BlockingReport,
    measure_blocking as measure_blocking,
)
from jaxsync.check._recompile import (
    CompileLog as CompileLog,
    RecompileError as RecompileError,
    count_compiles as count_compiles,
    no_recompile as no_recompile,
)
from jaxsync.check._report import (
    Report as Report,
    Row as Row,
    SyncFreeError as SyncFreeError,
    assert_sync_free as assert_sync_free,
    check_sync_free as check_sync_free,
)
from jaxsync.check._static import (
    Finding as Finding,
    lower as lower,
    scan_hlo as scan_hlo,
    scan_hlo_text as scan_hlo_text,
    scan_jaxpr as scan_jaxpr,
)
