"""What each driver capability needs inside a container (REFERENCE.md §4). The one table for runtime, CDI and
docker-args."""

# Where a driver root keeps its libraries (a root of its own like /usr/local/nvidia, or a distro's /).
DRIVER_LIB_DIRS = ("lib64", "lib", "usr/lib/x86_64-linux-gnu", "usr/lib64", "lib/x86_64-linux-gnu")

CAPABILITIES = ("utility", "compute", "video", "graphics", "display", "ngx", "compat32")
DEFAULT_CAPABILITIES = ("utility", "compute")

LIBRARIES = {
    "utility": ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq"),
    "compute": ("libcuda", "libcudadebugger", "libnvidia-opencl", "libnvidia-gpucomp", "libnvidia-ptxjitcompiler",
                "libnvidia-fatbinaryloader", "libnvidia-allocator", "libnvidia-compiler", "libnvidia-pkcs11",
                "libnvidia-pkcs11-openssl3", "libnvidia-nvvm"),
    "video": ("libvdpau_nvidia", "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid"),
    "graphics": ("libnvidia-eglcore", "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi", "libnvidia-fbc",
                 "libnvidia-ifr", "libnvidia-rtcore", "libnvoptix", "libGLX_nvidia", "libEGL_nvidia",
                 "libGLESv2_nvidia", "libGLESv1_CM_nvidia", "libnvidia-glvkspirv", "libnvidia-cbl"),
    "ngx": ("libnvidia-ngx",),
}
# video needs the compute libraries too (NVDEC/NVENC sit on CUDA).
IMPLIES = {"video": ("compute",)}
BINARIES = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
