"""What ``dsh-bash doctor`` tells the user to do about the SSH backend's infrastructure errors."""

from collections.abc import Mapping

from dsh_bash.backend import InfraReason

INFRA_HINTS: Mapping[InfraReason, str] = {
    "host_key_rejected": (
        "add the server's host key to known_hosts (ssh-keyscan -p PORT HOST >> ~/.ssh/known_hosts) or "
        "point known_hosts at a file that has it"
    ),
    "auth_failed": "check username and client_keys: the server must accept one of the keys",
    "host_unreachable": (
        "check host and port, that sshd runs there and that the network reaches it; raise "
        "connect_timeout_ms for a slow link"
    ),
    "spill_unavailable": (
        "make /tmp on the host writable for the user, and check free space there and "
        "max_spill_bytes/max_spill_total_bytes"
    ),
}
