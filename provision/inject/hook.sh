#!/bin/sh
# gpuprov-hook: stands in for NVIDIA's nvidia-container-runtime-hook so that `docker run --gpus …` is accepted
# by dockerd on hosts without NVIDIA's toolkit. When the container goes through gpuprov-runtime (the `nvidia`
# runtime, or the default runtime after `gpuprov engine configure docker --default`), the runtime removes this
# hook and injects the GPU itself. Reaching this script means the container went through plain runc instead.
echo "gpuprov: --gpus needs the gpuprov runtime: add --runtime nvidia, or make it the default with" \
     "'gpuprov engine configure docker --default'" >&2
exit 1
