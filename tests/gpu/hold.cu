// Holds N MiB of device memory on the one GPU it sees for S seconds, so gpuprov metrics can attribute it.
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <cuda_runtime.h>
__global__ void fill(char *p, size_t n) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) p[i] = 7; }
int main(int argc, char **argv) {
  size_t mib = argc > 1 ? atol(argv[1]) : 1024; int secs = argc > 2 ? atoi(argv[2]) : 30;
  int n = 0; cudaGetDeviceCount(&n);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  char bus[32]; cudaDeviceGetPCIBusId(bus, sizeof bus, 0);
  printf("devices=%d name=%s bus=%s\n", n, prop.name, bus); fflush(stdout);
  char *p; size_t sz = mib << 20;
  if (cudaMalloc(&p, sz) != cudaSuccess) { printf("cudaMalloc %zu MiB failed: %s\n", mib, cudaGetErrorString(cudaGetLastError())); return 2; }
  fill<<<(sz + 255) / 256, 256>>>(p, sz);
  char last = 0; cudaMemcpy(&last, p + sz - 1, 1, cudaMemcpyDeviceToHost);
  printf("holding %zu MiB, last byte %d\n", mib, last); fflush(stdout);
  sleep(secs); printf("done\n"); return last == 7 ? 0 : 3;
}
