"""Where packages come from, per distro family: the one table of repository URLs and keys (which packages: the
engine's in provision.decide.packages, the driver's in provision.decide.driver)."""
from __future__ import annotations

from provision.decide.targets import Target

# Each repository's base URL; `--mirror NAME=URL` (names: provision.options.Mirror) replaces one, e.g. with an
# internal mirror of the same tree. The paths below a base are the upstream layout.
BASES = {"elrepo": "https://www.elrepo.org", "epel": "https://dl.fedoraproject.org/pub/epel",
         "cuda": "https://developer.download.nvidia.com/compute/cuda/repos",
         "docker-ce": "https://download.docker.com/linux"}
MirrorMap = dict  # name -> base URL (only the ones overridden)


def base(name: str, mirrors: MirrorMap | None = None) -> str:
    return ((mirrors or {}).get(name) or BASES[name]).rstrip("/")


def elrepo_key(el: int, mirrors: MirrorMap | None = None) -> str:
    return f"{base('elrepo', mirrors)}/RPM-GPG-KEY-{'v2-' if el >= 9 else ''}elrepo.org"


def elrepo_release(el: int, mirrors: MirrorMap | None = None) -> str:
    return f"{base('elrepo', mirrors)}/elrepo-release-{el}.el{el}.elrepo.noarch.rpm"


CUDA_KEY = "D42D0685.pub"  # the signing key beside each tree's packages (the gpgkey of NVIDIA's .repo files)


def cuda_tree(target: Target) -> str:
    return "amzn2023" if target.os_id == "amzn" else f"rhel{target.el_major}"


def cuda_repo(target: Target, mirrors: MirrorMap | None = None) -> str:
    tree = cuda_tree(target)
    return f"{base('cuda', mirrors)}/{tree}/x86_64/cuda-{tree}.repo"


def cuda_repo_file(target: Target) -> str:
    """Where `config-manager --add-repo` saves NVIDIA's .repo file (its name, in /etc/yum.repos.d)."""
    return f"/etc/yum.repos.d/cuda-{cuda_tree(target)}.repo"


# NVIDIA's CUDA repository for Debian and Ubuntu: a flat apt repository per release (ubuntu2204/x86_64/), signed by
# the key beside it; NVIDIA's cuda-keyring package writes its list at CUDA_APT_LIST's path.
CUDA_APT_KEY = "3bf863cc.pub"
CUDA_APT_KEYRING = "/etc/apt/keyrings/cuda-archive-keyring.asc"


def cuda_apt_url(target: Target, mirrors: MirrorMap | None = None) -> str:
    return f"{base('cuda', mirrors)}/{target.os_id}{target.version.replace('.', '')}/x86_64"


def cuda_apt_list(target: Target) -> str:
    """cuda-keyring's own list file: one file names the repository (a second list naming the same URL with another
    Signed-By stops every apt run)."""
    return f"/etc/apt/sources.list.d/cuda-{target.os_id}{target.version.replace('.', '')}-x86_64.list"


def cuda_apt_source(target: Target, mirrors: MirrorMap | None = None) -> str:
    return f"deb [signed-by={CUDA_APT_KEYRING}] {cuda_apt_url(target, mirrors)}/ /\n"


# A distribution's own EPEL release package, where it has one in its repositories: Alibaba Cloud Linux 3's
# epel-aliyuncs-release (EPEL 8 from Alibaba's mirror) conflicts with EPEL's epel-release, and EPEL 8's repo file
# names `epel-$releasever`, which is 3 there.
OWN_EPEL_RELEASE = {"alinux": "epel-aliyuncs-release"}


def epel_release(target: Target, mirrors: MirrorMap | None = None) -> str:
    """What installs EPEL: the distribution's own release package by name, else EPEL's epel-release by URL."""
    return OWN_EPEL_RELEASE.get(target.os_id) or \
        f"{base('epel', mirrors)}/epel-release-latest-{target.el_major}.noarch.rpm"


DOCKER_CE_REPO_ID = "docker-ce-stable"  # the enabled repository of Docker's docker-ce.repo
DOCKER_CE_REPO_FILE = "/etc/yum.repos.d/docker-ce.repo"  # where `config-manager --add-repo` saves it


def docker_ce_gpg(target: Target, mirrors: MirrorMap | None = None) -> str:
    return f"{base('docker-ce', mirrors)}/{target.os_id}/gpg"


def docker_ce_repo_file(target: Target, mirrors: MirrorMap | None = None) -> str:
    distro = "rhel" if target.os_id == "rhel" else "centos"
    return f"{base('docker-ce', mirrors)}/{distro}/docker-ce.repo"


def mirror_setopts(name: str, target: Target, mirrors: MirrorMap | None = None) -> tuple[str, ...]:
    """`--setopt` options that point the enabled repository a release package (elrepo-release) or a fetched .repo
    file defines at the mirror (Docker's: docker_ce_setopts): those files name upstream's hosts whatever URL they
    came from, so without this every later dnf run behind `--mirror` fails on upstream's metadata. () without a
    mirror for `name`."""
    if not (mirrors or {}).get(name):
        return ()
    b = base(name, mirrors)
    if name == "elrepo":
        return (f"--setopt=elrepo.baseurl={b}/linux/elrepo/el{target.el_major}/$basearch/",
                "--setopt=elrepo.mirrorlist=")
    if name == "epel":  # epel-release's epel.repo: a metalink to upstream's mirror list, its baseurl commented out
        # the EL major, not $releasever: Alibaba Cloud Linux 3's is 3, and its EPEL is EPEL 8
        return (f"--setopt=epel.baseurl={b}/{target.el_major}/Everything/$basearch/", "--setopt=epel.metalink=")
    if name == "cuda":  # NVIDIA's cuda-<tree>.repo: one repository, id cuda-<tree>-x86_64
        tree = cuda_tree(target)
        return (f"--setopt=cuda-{tree}-x86_64.baseurl={b}/{tree}/x86_64",
                f"--setopt=cuda-{tree}-x86_64.gpgkey={b}/{tree}/x86_64/{CUDA_KEY}")
    return ()


def docker_ce_setopts(target: Target, mirrors: MirrorMap | None = None) -> tuple[str, ...]:
    """Docker's docker-ce.repo names its tree by `$releasever`: Alibaba Cloud Linux 3's is 3, and Docker has no
    centos/3 (its tree there is centos/8, the EL major, as Alibaba's own Docker guide sets it). The enabled repository
    is pointed at its mirror, or wherever `$releasever` is not the EL major; () otherwise (the file's own URLs)."""
    if not (mirrors or {}).get("docker-ce") and target.version == str(target.el_major):
        return ()
    b, distro = base("docker-ce", mirrors), "rhel" if target.os_id == "rhel" else "centos"
    return (f"--setopt={DOCKER_CE_REPO_ID}.baseurl={b}/{distro}/{target.el_major}/$basearch/stable",
            f"--setopt={DOCKER_CE_REPO_ID}.gpgkey={b}/{distro}/gpg")


def docker_ce_apt_source(target: Target, mirrors: MirrorMap | None = None) -> str:
    return (f"deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] {base('docker-ce', mirrors)}/"
            f"{target.os_id} {target.codename} stable\n")
