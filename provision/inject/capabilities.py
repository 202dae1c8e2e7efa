"""What each driver capability needs inside a container (REFERENCE.md §4). The one table for runtime, CDI and
docker-args."""

# Where a driver root keeps its 64-bit libraries: facts.driver_facts.DRIVER_LIB_DIRS (discovery reads it when it
# refreshes; not imported here: every cold GPU start imports this table, never the detect layer).
# Where it keeps 32-bit ones (the `compat32` capability; a datacentre driver root such as the H200 capture has none).
DRIVER_LIB32_DIRS = ("lib32", "usr/lib/i386-linux-gnu", "usr/lib/i386-linux-gnu/nvidia/current", "usr/lib32", "usr/lib")
# compat32 libraries go where the image's 32-bit loader looks: Debian's multiarch dir, else /usr/lib (RHEL).
LIB32_DEST = {"/usr/lib/x86_64-linux-gnu": "/usr/lib/i386-linux-gnu", "/usr/lib64": "/usr/lib"}

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
                 "libGLESv2_nvidia", "libGLESv1_CM_nvidia", "libnvidia-glvkspirv", "libnvidia-cbl",
                 "libnvidia-gpucomp", "libnvidia-vksc-core", "libnvidia-present", "libnvidia-allocator"),
    # gpucomp: GL and CUDA both; allocator: CUDA and the GBM backend (gbm/nvidia-drm_gbm.so)
    "ngx": ("libnvidia-ngx",),
}
# video needs the compute libraries too (NVDEC/NVENC sit on CUDA).
IMPLIES = {"video": ("compute",)}
BINARIES = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
    "ngx": (),
}

# Loader manifests: (capability, where a driver root may keep it (relative, glob allowed), where it goes in the
# container). The EGL/Vulkan/OpenCL loaders in the image find the driver only through these files; each names a
# library by its SONAME, which the runtime mounts in the image's default library directory.
MANIFESTS = (
    ("graphics", "vulkan/icd.d/nvidia_icd.json", "/usr/share/vulkan/icd.d/nvidia_icd.json"),
    ("graphics", "vulkan/icd.d/nvidia_icd.x86_64.json", "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json"),
    ("graphics", "vulkan/implicit_layer.d/nvidia_layers.json", "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
    ("graphics", "glvnd/egl_vendor.d/10_nvidia.json", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
    ("graphics", "egl/egl_external_platform.d/*nvidia*.json", "/usr/share/egl/egl_external_platform.d/"),
    ("graphics", "nvidia/nvoptix.bin", "/usr/share/nvidia/nvoptix.bin"),  # OptiX's shader cache seed, not JSON
    ("compute", "OpenCL/vendors/nvidia.icd", "/etc/OpenCL/vendors/nvidia.icd"),
)
# Where, under a driver root, those relative paths are looked for (first hit wins): a distro root keeps them in
# /usr/share or /etc, NVIDIA's self-contained roots (/usr/local/nvidia, GKE) in share/ or at the top.
MANIFEST_DIRS = ("usr/share", "share", "etc", "")

# The GSP firmware is loaded by the kernel module, not by anything in a container. Linux >= 5.7 reads firmware from
# init's mount namespace (firmware_loader: kernel_read_file_from_path_initns), so a container never needs it; on an
# older kernel the first open of the GPU from inside a container would make the kernel look in the container's
# filesystem — that is why NVIDIA's toolkit mounts gsp*.bin. gpuprov mounts it only on such kernels.
FIRMWARE_FROM_INIT_NS = (5, 7)

# NVIDIA's variables that add MIG's host-wide capabilities (mig/config, mig/monitor) to a privileged container
# (provision/inject/mig.py: admin_nodes).
MIG_ENV = ("NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES")

# Where NVIDIA's cuda-compat packages put the forward-compatibility libraries in an image (provision/inject/compat.py).
CUDA_COMPAT_DIR = "/usr/local/cuda/compat"
