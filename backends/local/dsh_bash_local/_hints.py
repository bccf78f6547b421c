"""What ``dsh-bash doctor`` tells the user to do about the local backend's infrastructure errors."""

from collections.abc import Mapping

from dsh_bash.backend import InfraReason

INFRA_HINTS: Mapping[InfraReason, str] = {
    "shell_missing": 'install bash, or set bash = "/path/to/bash" in the config',
    "spill_unavailable": (
        "make spill_dir (unset: $TMPDIR, else /tmp) writable for this user, and check free space there "
        "and max_spill_bytes/max_spill_total_bytes"
    ),
}
