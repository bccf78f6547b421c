"""Executors the benchmarks measure, made from a JSON-able context (so child interpreters can make them too).

The context: ``image`` (the Docker test image's tag) and ``labels`` (put on every container, so the
runner can remove them all at the end), ``ssh`` (``host``, ``port``, ``username``, ``client_keys``,
``known_hosts`` of a running sshd). Every backend runs with its default configuration otherwise.
"""

from __future__ import annotations

from typing import Any

from dsh_bash import BashExecutor

BACKENDS = ("local", "docker", "ssh")


def make_executor(backend: str, context: dict[str, Any]) -> BashExecutor:
    if backend == "local":
        from dsh_bash_local import LocalBashExecutor, LocalConfig  # noqa: PLC0415

        return LocalBashExecutor(LocalConfig())
    if backend == "docker":
        from dsh_bash_docker import DockerBashExecutor, DockerConfig  # noqa: PLC0415

        return DockerBashExecutor(DockerConfig(image=context["image"], labels=context.get("labels", {})))
    if backend == "ssh":
        from dsh_bash_ssh import SshBashExecutor, SshConfig  # noqa: PLC0415

        return SshBashExecutor(SshConfig(**context["ssh"]))
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
