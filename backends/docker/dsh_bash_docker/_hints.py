"""What ``dsh-bash doctor`` tells the user to do about the Docker backend's infrastructure errors."""

from collections.abc import Mapping

from dsh_bash.backend import InfraReason

INFRA_HINTS: Mapping[InfraReason, str] = {
    "engine_unreachable": (
        "start the Docker engine (dockerd, or Docker Desktop), or set docker_host (or DOCKER_HOST) to the "
        "socket it listens on, e.g. unix:///var/run/docker.sock; if it runs, give this user access to that "
        "socket (the docker group) and check that it is healthy (docker info); for tcp:// with TLS, check "
        "tls_ca_cert, tls_client_cert and tls_client_key (or DOCKER_CERT_PATH); for ssh://, that "
        "`ssh USER@HOST docker system dial-stdio` works with the same keys and known_hosts; --timeout "
        "raises the bound"
    ),
    "image_missing": 'pull the image (docker pull IMAGE) or set pull = "missing" in the config',
    "container_missing": (
        "name an existing, running container in 'container' (docker ps -a lists them, docker start NAME "
        "starts one), or use 'image'"
    ),
    "spill_unavailable": (
        "make /tmp in the container writable, and check free space there and "
        "max_spill_bytes/max_spill_total_bytes"
    ),
}
