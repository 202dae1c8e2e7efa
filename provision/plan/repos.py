"""Where packages come from, per distro family: the one table of repository URLs, keys and package names for
engines (driver packages come from provision.decide.driver)."""
from __future__ import annotations

from provision.decide.targets import Target

ELREPO_KEY = {7: "https://www.elrepo.org/RPM-GPG-KEY-elrepo.org", 8: "https://www.elrepo.org/RPM-GPG-KEY-elrepo.org",
              9: "https://www.elrepo.org/RPM-GPG-KEY-v2-elrepo.org",
              10: "https://www.elrepo.org/RPM-GPG-KEY-v2-elrepo.org"}


def elrepo_release(el: int) -> str:
    return f"https://www.elrepo.org/elrepo-release-{el}.el{el}.elrepo.noarch.rpm"


def cuda_repo(target: Target) -> str:
    tree = "amzn2023" if target.os_id == "amzn" else f"rhel{target.el_major}"
    return f"https://developer.download.nvidia.com/compute/cuda/repos/{tree}/x86_64/cuda-{tree}.repo"


def epel_release(el: int) -> str:
    return f"https://dl.fedoraproject.org/pub/epel/epel-release-latest-{el}.noarch.rpm"


DOCKER_CE_GPG = {"debian": "https://download.docker.com/linux/debian/gpg",
                 "ubuntu": "https://download.docker.com/linux/ubuntu/gpg"}


def docker_ce_repo_file(target: Target) -> str:
    distro = "rhel" if target.os_id == "rhel" else "centos"
    return f"https://download.docker.com/linux/{distro}/docker-ce.repo"


def docker_ce_apt_source(target: Target) -> str:
    return (f"deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] https://download.docker.com/linux/"
            f"{target.os_id} {target.codename} stable\n")


def engine_packages(target: Target, engine: str, source: str) -> tuple[str, ...]:
    if engine == "containerd":
        return ("containerd",) if target.family == "debian" else ("containerd.io",)
    if source == "docker-ce":
        return ("docker-ce", "docker-ce-cli", "containerd.io")
    if target.family == "debian":
        return ("docker.io",)
    if target.os_id == "amzn":
        return ("docker",)
    return ("moby-engine",)  # Fedora-family Moby; EL proper ships no Docker (the default there is docker-ce)


def debian_components(target: Target) -> tuple[str, ...]:
    if target.os_id == "ubuntu":
        return ("restricted", "multiverse")
    return ("contrib", "non-free") + (("non-free-firmware",) if int(target.version) >= 12 else ())
