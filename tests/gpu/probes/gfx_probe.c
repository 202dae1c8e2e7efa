/* Headless graphics probe for GPU containers: `gfx_probe egl` opens an EGL device display (EGL_EXT_device_base,
 * no X, no window), makes a GLES context current on a pbuffer and prints the vendor and renderer; `gfx_probe vulkan`
 * lists Vulkan physical devices. Only the loaders (Debian's libEGL.so.1 / libvulkan.so.1) are dlopen'ed: which
 * driver they find depends on the ICD/vendor manifests and libraries the runtime mounted. Exit 0 only when an NVIDIA
 * device answered; 3 when the loader found no driver (a clean failure), 2 when a loader is missing.
 * Built with: gcc -O2 -o gfx_probe gfx_probe.c -ldl (no EGL/Vulkan headers needed). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef void *EGLDisplay, *EGLDeviceEXT, *EGLConfig, *EGLSurface, *EGLContext;
typedef int EGLint;
typedef unsigned int EGLBoolean, EGLenum;
#define EGL_NONE 0x3038
#define EGL_VENDOR 0x3053
#define EGL_VERSION 0x3054
#define EGL_PLATFORM_DEVICE_EXT 0x313F
#define EGL_SURFACE_TYPE 0x3033
#define EGL_PBUFFER_BIT 0x0001
#define EGL_RENDERABLE_TYPE 0x3040
#define EGL_OPENGL_ES2_BIT 0x0004
#define EGL_WIDTH 0x3057
#define EGL_HEIGHT 0x3056
#define EGL_OPENGL_ES_API 0x30A0
#define EGL_CONTEXT_CLIENT_VERSION 0x3098
#define GL_VENDOR 0x1F00
#define GL_RENDERER 0x1F01

static int egl(void) {
  void *h = dlopen("libEGL.so.1", RTLD_NOW);
  if (!h) { printf("EGL loader missing: %s\n", dlerror()); return 2; }
  void *(*gpa)(const char *) = (void *(*)(const char *))dlsym(h, "eglGetProcAddress");
  EGLBoolean (*queryDevices)(EGLint, EGLDeviceEXT *, EGLint *) = gpa("eglQueryDevicesEXT");
  EGLDisplay (*getPlatformDisplay)(EGLenum, void *, const EGLint *) = gpa("eglGetPlatformDisplayEXT");
  EGLBoolean (*init)(EGLDisplay, EGLint *, EGLint *) = dlsym(h, "eglInitialize");
  const char *(*queryString)(EGLDisplay, EGLint) = dlsym(h, "eglQueryString");
  EGLBoolean (*chooseConfig)(EGLDisplay, const EGLint *, EGLConfig *, EGLint, EGLint *) = dlsym(h, "eglChooseConfig");
  EGLSurface (*pbuffer)(EGLDisplay, EGLConfig, const EGLint *) = dlsym(h, "eglCreatePbufferSurface");
  EGLBoolean (*bindApi)(EGLenum) = dlsym(h, "eglBindAPI");
  EGLContext (*createContext)(EGLDisplay, EGLConfig, EGLContext, const EGLint *) = dlsym(h, "eglCreateContext");
  EGLBoolean (*makeCurrent)(EGLDisplay, EGLSurface, EGLSurface, EGLContext) = dlsym(h, "eglMakeCurrent");
  EGLDeviceEXT devs[16];
  EGLint n = 0;
  if (!queryDevices || !getPlatformDisplay || !queryDevices(16, devs, &n) || n == 0) {
    printf("EGL: no EGL device (no vendor library found by the loader)\n");
    return 3;
  }
  printf("EGL devices: %d\n", n);
  EGLDisplay d = getPlatformDisplay(EGL_PLATFORM_DEVICE_EXT, devs[0], NULL);
  EGLint major = 0, minor = 0;
  if (!d || !init(d, &major, &minor)) { printf("EGL: eglInitialize failed\n"); return 3; }
  printf("EGL_VENDOR=%s\nEGL_VERSION=%s\n", queryString(d, EGL_VENDOR), queryString(d, EGL_VERSION));
  EGLint cattr[] = {EGL_SURFACE_TYPE, EGL_PBUFFER_BIT, EGL_RENDERABLE_TYPE, EGL_OPENGL_ES2_BIT, EGL_NONE};
  EGLConfig cfg;
  EGLint ncfg = 0;
  EGLint sattr[] = {EGL_WIDTH, 64, EGL_HEIGHT, 64, EGL_NONE};
  EGLint xattr[] = {EGL_CONTEXT_CLIENT_VERSION, 2, EGL_NONE};
  if (!chooseConfig(d, cattr, &cfg, 1, &ncfg) || ncfg < 1) { printf("EGL: no pbuffer config\n"); return 3; }
  EGLSurface s = pbuffer(d, cfg, sattr);
  bindApi(EGL_OPENGL_ES_API);
  EGLContext c = createContext(d, cfg, NULL, xattr);
  if (!s || !c || !makeCurrent(d, s, s, c)) { printf("EGL: no current GLES context\n"); return 3; }
  const unsigned char *(*getString)(unsigned) = gpa("glGetString");
  const char *vendor = getString ? (const char *)getString(GL_VENDOR) : NULL;
  const char *renderer = getString ? (const char *)getString(GL_RENDERER) : NULL;
  printf("GL_VENDOR=%s\nGL_RENDERER=%s\n", vendor ? vendor : "?", renderer ? renderer : "?");
  const char *v = queryString(d, EGL_VENDOR);
  return (v && strstr(v, "NVIDIA") && renderer && strstr(renderer, "NVIDIA")) ? 0 : 4;
}

typedef struct { int sType; const void *pNext; const char *app; unsigned appv; const char *eng; unsigned engv;
                 unsigned api; } VkApplicationInfo;
typedef struct { int sType; const void *pNext; unsigned flags; const VkApplicationInfo *app; unsigned nl;
                 const char *const *l; unsigned ne; const char *const *e; } VkInstanceCreateInfo;

static int vulkan(void) {
  void *h = dlopen("libvulkan.so.1", RTLD_NOW);
  if (!h) { printf("Vulkan loader missing: %s\n", dlerror()); return 2; }
  int (*create)(const VkInstanceCreateInfo *, const void *, void **) = dlsym(h, "vkCreateInstance");
  int (*enumerate)(void *, unsigned *, void **) = dlsym(h, "vkEnumeratePhysicalDevices");
  void (*props)(void *, void *) = dlsym(h, "vkGetPhysicalDeviceProperties");
  VkApplicationInfo app = {0, NULL, "gpuprov-probe", 1, "none", 1, (1u << 22) | (1u << 12)};  /* 1.1 */
  VkInstanceCreateInfo ci = {1, NULL, 0, &app, 0, NULL, 0, NULL};
  void *inst = NULL;
  int r = create(&ci, NULL, &inst);
  if (r != 0) { printf("Vulkan: vkCreateInstance failed (%d): no ICD found by the loader\n", r); return 3; }
  unsigned n = 0;
  void *devs[16];
  enumerate(inst, &n, NULL);
  if (n > 16) n = 16;
  enumerate(inst, &n, devs);
  int nvidia = 0;
  for (unsigned i = 0; i < n; i++) {
    static unsigned char p[4096];  /* VkPhysicalDeviceProperties: deviceName at offset 20 */
    props(devs[i], p);
    unsigned vendor = *(unsigned *)(p + 8);
    printf("Vulkan device %u: %s (vendor 0x%04x)\n", i, (char *)(p + 20), vendor);
    nvidia |= vendor == 0x10de;
  }
  if (n == 0) { printf("Vulkan: no physical device\n"); return 3; }
  return nvidia ? 0 : 4;
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "vulkan")) return vulkan();
  return egl();
}
