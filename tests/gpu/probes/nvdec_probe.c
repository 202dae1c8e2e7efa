/* Hardware video decode probe for GPU containers: dlopen's the driver's libcuda.so.1 and libnvcuvid.so.1 (what the
 * `video` capability mounts), asks NVDEC for its H.264 capabilities, then decodes an Annex-B H.264 file on the GPU
 * through NVIDIA's parser + decoder and reads the decoded NV12 luma back: prints frames, size and mean Y.
 * Exit 0 when every frame decoded; 3 when libnvcuvid is not there (video not granted), 4 on a decode failure.
 * Structures are laid out as in NVIDIA's cuviddec.h / nvcuvid.h (Video Codec SDK 12), each padded so a driver with
 * larger structures never writes past them. Built with: gcc -O2 -o nvdec_probe nvdec_probe.c -ldl */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef long long CUvideotimestamp;
enum { H264 = 4, CHROMA_420 = 1, NV12 = 0, PREFER_CUVID = 4, PKT_ENDOFSTREAM = 1 };

typedef union {
  struct { int codec, chroma; unsigned depth_minus8, r1[3]; unsigned char supported, num_nvdecs;
           unsigned short out_mask; unsigned max_w, max_h, max_mb; unsigned short min_w, min_h; } f;
  char pad[512];
} DecodeCaps;
typedef struct {
  int codec; unsigned fr_num, fr_den; unsigned char progressive, luma_m8, chroma_m8, min_surfaces;
  unsigned coded_width, coded_height; int left, top, right, bottom; int chroma_format;
} VideoFormat;
typedef union {
  struct { unsigned long w, h, num_surfaces; int codec, chroma; unsigned long flags, depth_m8, intra_only, max_w,
           max_h, r1; short dl, dt, dr, db; int out_format, deinterlace; unsigned long tw, th, num_out;
           void *lock; short tl, tt, tr, tb; unsigned long hist, r2[4]; } f;
  char pad[1024];
} DecoderCreateInfo;
typedef union {
  struct { int codec; unsigned max_surfaces, clock, err_threshold, max_display_delay, annexb_flags, r1[4];
           void *user; int (*seq)(void *, VideoFormat *); int (*decode)(void *, void *);
           int (*display)(void *, int *); } f;
  char pad[1024];
} ParserParams;
typedef struct { unsigned long flags, size; const unsigned char *payload; CUvideotimestamp ts; } Packet;
typedef union { struct { int progressive, second_field, tff, unpaired; } f; char pad[1024]; } ProcParams;

static CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDeviceGetName)(char *, int, int),
    (*cuPrimaryCtxRetain)(void **, int), (*cuCtxSetCurrent)(void *), (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*getCaps)(DecodeCaps *), (*createParser)(void **, ParserParams *), (*parse)(void *, Packet *),
    (*createDecoder)(void **, DecoderCreateInfo *), (*decodePicture)(void *, void *),
    (*mapFrame)(void *, int, CUdeviceptr *, unsigned *, ProcParams *), (*unmapFrame)(void *, CUdeviceptr);
static void *decoder;
static unsigned width, height;
static int frames, failures;
static double luma_sum;

static int on_sequence(void *u, VideoFormat *fmt) {
  (void)u;
  width = fmt->coded_width; height = fmt->coded_height;
  DecoderCreateInfo ci; memset(&ci, 0, sizeof ci);
  ci.f.w = ci.f.max_w = ci.f.tw = width; ci.f.h = ci.f.max_h = ci.f.th = height;
  ci.f.num_surfaces = fmt->min_surfaces > 8 ? fmt->min_surfaces : 8; ci.f.num_out = 2;
  ci.f.codec = fmt->codec; ci.f.chroma = fmt->chroma_format; ci.f.flags = PREFER_CUVID; ci.f.out_format = NV12;
  ci.f.dr = (short)width; ci.f.db = (short)height; ci.f.tr = (short)width; ci.f.tb = (short)height;
  CUresult r = createDecoder(&decoder, &ci);
  if (r) { printf("cuvidCreateDecoder failed: %d\n", r); failures++; return 0; }
  printf("decoder: H.264 %ux%u, %lu surfaces\n", width, height, ci.f.num_surfaces);
  return (int)ci.f.num_surfaces;
}
static int on_decode(void *u, void *pic) { (void)u; if (decodePicture(decoder, pic)) failures++; return 1; }
static int on_display(void *u, int *disp) {
  (void)u;
  if (!disp) return 1;
  ProcParams pp; memset(&pp, 0, sizeof pp); pp.f.progressive = 1;
  CUdeviceptr frame = 0; unsigned pitch = 0;
  if (mapFrame(decoder, disp[0], &frame, &pitch, &pp)) { failures++; return 0; }
  unsigned char *row = malloc(pitch);
  for (unsigned y = 0; y < height; y += height / 4 ? height / 4 : 1) {
    if (cuMemcpyDtoH(row, frame + (CUdeviceptr)y * pitch, pitch)) { failures++; break; }
    for (unsigned x = 0; x < width; x++) luma_sum += row[x] / (double)(width * 4);
  }
  free(row); unmapFrame(decoder, frame); frames++;
  return 1;
}

#define SYM(lib, var, name) if (!(*(void **)&var = dlsym(lib, name))) { printf("missing %s\n", name); return 4; }
int main(int argc, char **argv) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) { printf("libcuda.so.1 not found: %s\n", dlerror()); return 3; }
  void *cuvid = dlopen("libnvcuvid.so.1", RTLD_NOW);
  if (!cuvid) { printf("libnvcuvid.so.1 not found (NVDEC library not mounted): %s\n", dlerror()); return 3; }
  SYM(cuda, cuInit, "cuInit") SYM(cuda, cuDeviceGet, "cuDeviceGet") SYM(cuda, cuDeviceGetName, "cuDeviceGetName")
  SYM(cuda, cuPrimaryCtxRetain, "cuDevicePrimaryCtxRetain") SYM(cuda, cuCtxSetCurrent, "cuCtxSetCurrent")
  SYM(cuda, cuMemcpyDtoH, "cuMemcpyDtoH_v2") SYM(cuvid, getCaps, "cuvidGetDecoderCaps")
  SYM(cuvid, createParser, "cuvidCreateVideoParser") SYM(cuvid, parse, "cuvidParseVideoData")
  SYM(cuvid, createDecoder, "cuvidCreateDecoder") SYM(cuvid, decodePicture, "cuvidDecodePicture")
  SYM(cuvid, mapFrame, "cuvidMapVideoFrame64") SYM(cuvid, unmapFrame, "cuvidUnmapVideoFrame64")
  int dev; void *ctx; char name[256];
  CUresult r = cuInit(0);
  if (!r) r = cuDeviceGet(&dev, 0);
  if (!r) r = cuDeviceGetName(name, sizeof name, dev);
  if (!r) r = cuPrimaryCtxRetain(&ctx, dev);
  if (!r) r = cuCtxSetCurrent(ctx);
  if (r) { printf("CUDA init failed: %d\n", r); return 4; }
  DecodeCaps caps; memset(&caps, 0, sizeof caps);
  caps.f.codec = H264; caps.f.chroma = CHROMA_420;
  if ((r = getCaps(&caps))) { printf("cuvidGetDecoderCaps failed: %d\n", r); return 4; }
  printf("device: %s\nNVDEC H.264 4:2:0 8-bit: supported=%d engines=%d max=%ux%u\n", name, caps.f.supported,
         caps.f.num_nvdecs, caps.f.max_w, caps.f.max_h);
  if (!caps.f.supported) return 4;
  if (argc < 2) return 0;
  FILE *fh = fopen(argv[1], "rb");
  if (!fh) { perror(argv[1]); return 4; }
  static unsigned char buf[1 << 22];
  size_t len = fread(buf, 1, sizeof buf, fh); fclose(fh);
  ParserParams pp; memset(&pp, 0, sizeof pp);
  pp.f.codec = H264; pp.f.max_surfaces = 8; pp.f.max_display_delay = 0;
  pp.f.seq = on_sequence; pp.f.decode = on_decode; pp.f.display = on_display;
  void *parser;
  if ((r = createParser(&parser, &pp))) { printf("cuvidCreateVideoParser failed: %d\n", r); return 4; }
  Packet pkt = {0, len, buf, 0};
  parse(parser, &pkt);
  Packet eos = {PKT_ENDOFSTREAM, 0, NULL, 0};
  parse(parser, &eos);
  printf("decoded %d frames %ux%u on NVDEC, mean luma %.1f, failures %d\n", frames, width, height,
         frames ? luma_sum / frames : 0.0, failures);
  return frames > 0 && !failures ? 0 : 4;
}
