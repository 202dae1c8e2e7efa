/* gpuprov-runtime, compiled front-end.  Same contract as provision/inject/shim.py (one argv table tests both):
 *   - every runc command except `create` (and `run`, which creates) is exec'd into runc at once (no allocation; on
 *     x86_64 and aarch64 before the C library starts, as is a create that asks for no GPU: see PRELIBC below);
 *   - `create` reads the bundle's config.json; only when it mentions a GPU request does it ask the warm editor
 *     (provision/inject/server.py) over a root-only unix socket, or run the Python editor itself (isolated
 *     interpreter, fixed minimal environment) when no trusted editor answers within REPLY_TIMEOUT_S; then exec runc.
 * Never hangs on the editor: connect is non-blocking, the reply has a deadline, and a socket is trusted only when it,
 * its directory and the process listening on it belong to our own uid (root) with no group/other access.
 *
 * Built once, without paths (the wheel carries the binary: hosts need no compiler). `gpuprov runtime install` writes
 * the runc, python and editor paths into the three fixed-size slots below (provision/inject/install.py: patch_slots).
 */
#define _GNU_SOURCE /* struct ucred (SO_PEERCRED) */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SLOT 4096
#define REPLY_TIMEOUT_S 3
/* Not const and not static: the compiler must read them at run time (install.py rewrites them in the binary). */
char gpuprov_slot_runc[SLOT] = "@@GPUPROV-SLOT:runc@@";
char gpuprov_slot_python[SLOT] = "@@GPUPROV-SLOT:python@@";
char gpuprov_slot_modify[SLOT] = "@@GPUPROV-SLOT:modify@@";

/* --- Before the C library starts: the fast path ---
 * A statically linked glibc spends ~0.3 ms of CPU starting before main() runs (its CPU-feature probing: CPUID, which
 * traps to the hypervisor in a VM; bench/frontend_bench.py), and every runc command an engine sends (state, start,
 * kill, delete, a create with no GPU) would pay it on top of runc's own start. Where PRELIBC_ENTRY is defined
 * (x86_64, aarch64) frontend_build.py links the static binary with gpuprov_entry as its entry point: it parses argv and
 * reads config.json with raw system calls and execs runc when nothing is to be edited, before the C library ever
 * starts. Any other case (a create that mentions a GPU, an error, no command) jumps to the C library's own entry
 * (_start) with the stack as the kernel left it, and main() decides everything again: the fast path only ever skips
 * work that main() would also skip, with the same helpers (parse, scan_config).
 * Code that runs there may call nothing from the C library (not even a memset or strcpy the compiler could emit for a
 * loop: the empty asm in such loops prevents that) and may not use the stack protector (its canary lives in
 * thread-local storage, not set up yet): PRELIBC marks it. Tables are arrays, not pointers: nothing to relocate. */
#if defined(__has_attribute)
#if __has_attribute(no_stack_protector)
#define PRELIBC __attribute__((no_stack_protector))
#endif
#endif
#ifndef PRELIBC
#define PRELIBC __attribute__((optimize("no-stack-protector")))
#endif
#if defined(__x86_64__) || defined(__aarch64__)
#define PRELIBC_ENTRY 1
#include <sys/syscall.h>
/* A system call without errno (thread-local): returns -errno on failure. */
PRELIBC static long raw_syscall(long n, long a, long b, long c) {
#if defined(__x86_64__)
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
#else
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
    return x0;
#endif
}
#define RAW_OPEN(path) ((int)raw_syscall(SYS_openat, AT_FDCWD, (long)(path), O_RDONLY | O_CLOEXEC))
#define RAW_READ(fd, buf, n) raw_syscall(SYS_read, (fd), (long)(buf), (long)(n))
#define RAW_FSTAT(fd, st) raw_syscall(SYS_fstat, (fd), (long)(st), 0)
#define RAW_CLOSE(fd) raw_syscall(SYS_close, (fd), 0, 0)
#else /* no fast path: the C library's own calls */
#define RAW_OPEN(path) open((path), O_RDONLY | O_CLOEXEC)
#define RAW_READ(fd, buf, n) read((fd), (buf), (n))
#define RAW_FSTAT(fd, st) fstat((fd), (st))
#define RAW_CLOSE(fd) close(fd)
#endif

/* runc parses options with Go's flag package: `-x` and `--x` are the same option, a value comes as `--x=v` or as the
 * next word. Global options that take a value, and those of create/run (provision/inject/shim.py has the same). */
static const char global_value_opts[][16] = {"root", "log", "log-format", "criu", "rootless", ""};
static const char create_value_opts[][16] = {"bundle", "b", "console-socket", "pid-file", "preserve-fds", ""};
/* Strings whose presence means the Python editor must look (it decides precisely; this only filters). */
#define TRIGGER_MAX 40
static const char triggers[][TRIGGER_MAX] = {"NVIDIA_VISIBLE_DEVICES=", "nvidia-container-runtime-hook",
                                             "/var/run/nvidia-container-devices/", "GPUPROV_GPU_", "ALIYUN_COM_GPU_", ""};

PRELIBC static int same(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

/* The option's name without its one or two dashes, or NULL for a word that is not an option. */
PRELIBC static const char *opt_name(const char *a) {
    if (a[0] != '-' || a[1] == 0) return NULL;
    return a[1] == '-' ? a + 2 : a + 1;
}

/* Does `name` (from opt_name) spell one of `table`? Sets *inline_value for the `name=value` form. */
PRELIBC static const char *match_opt(const char *name, const char (*table)[16], const char **inline_value) {
    *inline_value = NULL;
    for (int i = 0; table[i][0]; i++) {
        int n = 0;
        while (table[i][n] && name[n] == table[i][n]) n++;
        if (table[i][n]) continue;
        if (name[n] == 0) return table[i];
        if (name[n] == '=') { *inline_value = name + n + 1; return table[i]; }
    }
    return NULL;
}

struct parsed {
    int cmd_index; /* argv index of the command, 0 if none */
    const char *log, *log_format, *bundle;
};

PRELIBC static struct parsed parse(int argc, char **argv) {
    struct parsed p = {0, "", "", "."};
    int i = 1;
    while (i < argc) {
        const char *name = opt_name(argv[i]), *val, *opt;
        if (!name) { p.cmd_index = i; break; }
        if (name[0] == 0) { p.cmd_index = i + 1 < argc ? i + 1 : 0; break; } /* `--` ends the options */
        if ((opt = match_opt(name, global_value_opts, &val))) {
            if (!val) val = i + 1 < argc ? argv[++i] : "";
            if (same(opt, "log")) p.log = val;
            else if (same(opt, "log-format")) p.log_format = val;
        }
        i++;
    }
    if (!p.cmd_index) return p;
    for (int j = p.cmd_index + 1; j < argc; j++) { /* runc takes create's options before or after the id */
        const char *name = opt_name(argv[j]), *val, *opt;
        if (!name) continue;
        if (name[0] == 0) break;
        if ((opt = match_opt(name, create_value_opts, &val))) {
            if (!val) val = j + 1 < argc ? argv[++j] : "";
            if (opt[0] == 'b') p.bundle = val;
        }
    }
    return p;
}

PRELIBC static int creates(const char *cmd) { return same(cmd, "create") || same(cmd, "run"); }

/* Does a trigger start at p (with `avail` bytes readable there)? */
PRELIBC static int trigger_at(const char *p, long avail) {
    for (int t = 0; triggers[t][0]; t++) {
        long n = 0;
        while (n < avail && triggers[t][n] && p[n] == triggers[t][n]) n++;
        if (!triggers[t][n]) return 1;
    }
    return 0;
}

/* Whether the bundle's config.json mentions a GPU request: 1 yes, 0 no, -1 it cannot be read (runc reports that).
 * Read up to its size at open and up to its first NUL byte (runc refuses such a file anyway), in windows that
 * overlap by a trigger's length. */
PRELIBC static int scan_config(const char *bundle) {
    static const char name[] = "/config.json";
    char path[4096];
    long k = 0;
    for (; bundle[k]; k++) {
        if (k >= (long)(sizeof path - sizeof name)) return -1;
        path[k] = bundle[k];
        __asm__(""); /* not a strcpy call: this may run before the C library starts */
    }
    for (long j = 0; j < (long)sizeof name; j++) { path[k + j] = name[j]; __asm__(""); }
    int fd = RAW_OPEN(path);
    if (fd < 0) return -1;
    struct stat st;
    if (RAW_FSTAT(fd, &st) != 0) { RAW_CLOSE(fd); return -1; }
    char buf[32768];
    long left = st.st_size, have = 0;
    int hit = 0;
    for (;;) {
        while (have < (long)sizeof buf && left > 0) {
            long n = RAW_READ(fd, buf + have, left < (long)sizeof buf - have ? left : (long)sizeof buf - have);
            if (n < 0) { RAW_CLOSE(fd); return -1; }
            if (n == 0) left = 0;
            have += n, left -= n;
        }
        int last = left <= 0;
        long upto = last ? have : have - (TRIGGER_MAX - 1); /* a trigger starting further may run past the window */
        long i = 0;
        while (i < upto && buf[i] && !(hit = trigger_at(buf + i, have - i))) i++;
        if (hit || i < upto || last) break; /* a match, a NUL byte, or the end */
        for (long j = upto; j < have; j++) { buf[j - upto] = buf[j]; __asm__(""); } /* not a memmove call */
        have -= upto;
    }
    RAW_CLOSE(fd);
    return hit;
}

#ifdef PRELIBC_ENTRY
/* Called by gpuprov_entry with the kernel's initial stack (argc, argv..., NULL, envp..., NULL). Execs runc when the
 * call needs no edit; returns (and the C library starts, then main()) otherwise. */
PRELIBC __attribute__((used)) void gpuprov_fast(long *sp) {
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1), **envp = argv + argc + 1;
    struct parsed p = parse(argc, argv);
    if (!p.cmd_index) return; /* no command: main() says what (--gpuprov-front-end) */
    if (creates(argv[p.cmd_index]) && scan_config(p.bundle) != 0) return;
    char *arg0 = argv[0];
    argv[0] = gpuprov_slot_runc;
    raw_syscall(SYS_execve, (long)gpuprov_slot_runc, (long)argv, (long)envp);
    argv[0] = arg0; /* exec failed: main() execs again and says why */
}
/* The entry point: keeps the kernel's stack pointer and the register _start reads (rtld_fini: rdx / x0) in
 * callee-saved registers, calls gpuprov_fast on an aligned stack, then hands both to _start unchanged. */
#if defined(__x86_64__)
__asm__(".text\n.globl gpuprov_entry\n.type gpuprov_entry,@function\ngpuprov_entry:\n"
        "  mov %rsp, %rbx\n  mov %rdx, %r12\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call gpuprov_fast\n"
        "  mov %r12, %rdx\n  mov %rbx, %rsp\n  jmp _start\n");
#else
__asm__(".text\n.globl gpuprov_entry\n.type gpuprov_entry,%function\ngpuprov_entry:\n"
        "  mov x19, sp\n  mov x20, x0\n  mov x0, sp\n  bl gpuprov_fast\n  mov x0, x20\n  mov sp, x19\n  b _start\n");
#endif
#endif

static void exec_runc(char **argv) {
    argv[0] = gpuprov_slot_runc;
    execv(gpuprov_slot_runc, argv);
    fprintf(stderr, "gpuprov-runtime: cannot exec %s: %s\n", gpuprov_slot_runc, strerror(errno));
    _exit(127);
}

/* The warm editor's socket (provision/inject/server.py): next to GPUPROV_RUNTIME_CONFIG when that is set. */
static void socket_path(char *out, size_t n) {
    const char *cfg = getenv("GPUPROV_RUNTIME_CONFIG");
    if (cfg && strlen(cfg) < n - 6) snprintf(out, n, "%s.sock", cfg);
    else snprintf(out, n, "%s", "/run/gpuprov/runtime-editor.sock");
}

/* Trust the socket only if nobody but us (root) could have made it: the socket and its directory are ours, the socket
 * has no group/other access, the directory no group/other write. Says why on stderr when it refuses. */
static int socket_trusted(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0; /* no editor yet: the quiet, common case */
    uid_t me = geteuid();
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir) slash[1] = 0; else if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
    struct stat dst;
    const char *why = NULL;
    if (!S_ISSOCK(st.st_mode)) why = "not a socket";
    else if (st.st_uid != me) why = "owned by another user";
    else if (st.st_mode & 077) why = "open to group or others";
    else if (stat(dir, &dst) != 0 || dst.st_uid != me || (dst.st_mode & 022)) why = "its directory is not root's alone";
    if (!why) return 1;
    fprintf(stderr, "gpuprov-runtime: not trusting the editor socket %s (%s); editing directly\n", path, why);
    return 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Ask the warm editor: returns its exit code, or -1 when no trusted editor answers in time (then the editor runs
 * directly). Nothing here can block for longer than REPLY_TIMEOUT_S. */
static int ask_server(const char *bundle, const char *log, const char *log_format) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    socket_path(addr.sun_path, sizeof addr.sun_path);
    if (!socket_trusted(addr.sun_path)) return -1;
    /* Non-blocking connect: a unix socket whose backlog is full (a stopped editor) answers EAGAIN at once. */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) { close(fd); return -1; }
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != geteuid()) {
        fprintf(stderr, "gpuprov-runtime: the editor socket %s is served by uid %d, not ours; editing directly\n",
                addr.sun_path, (int)cred.uid);
        close(fd);
        return -1;
    }
    char req[12400];
    int len = snprintf(req, sizeof req, "%s\t%s\t%s\n", bundle, log, log_format);
    if (len <= 0 || (size_t)len >= sizeof req) { close(fd); return -1; }
    double deadline = now() + REPLY_TIMEOUT_S;
    char resp[4096] = {0};
    int sent = 0, got = 0;
    while (!memchr(resp, '\n', got)) {
        int left_ms = (int)((deadline - now()) * 1000);
        struct pollfd pfd = {fd, sent < len ? POLLOUT : POLLIN, 0};
        int ready = left_ms > 0 ? poll(&pfd, 1, left_ms) : 0;
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) {
            fprintf(stderr, "gpuprov-runtime: the warm editor did not answer within %d s; editing directly\n",
                    REPLY_TIMEOUT_S);
            close(fd);
            return -1;
        }
        ssize_t r = sent < len ? send(fd, req + sent, len - sent, MSG_NOSIGNAL) : read(fd, resp + got, sizeof resp - 1 - got);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (r <= 0 || got + r >= (int)sizeof resp - 1) { close(fd); return -1; } /* hung up: edit directly */
        if (sent < len) sent += r; else got += r;
    }
    close(fd);
    char *end;
    long rc = strtol(resp, &end, 10);
    if (end == resp || (*end != '\t' && *end != '\n') || rc < 0 || rc > 255) return -1; /* not an editor's answer */
    if (*end == '\t' && end[1] != '\n') fprintf(stderr, "%.*s\n", (int)(strchr(end, '\n') - end - 1), end + 1);
    return (int)rc;
}

int main(int argc, char **argv) {
    struct parsed p = parse(argc, argv);
    const char *cmd = p.cmd_index ? argv[p.cmd_index] : NULL;
    if (!cmd && argc == 2 && strcmp(argv[1], "--gpuprov-front-end") == 0) { /* install's check that we run here */
        printf("gpuprov-runtime compiled front-end; runc %s\n", gpuprov_slot_runc);
        return gpuprov_slot_runc[0] == '/' ? 0 : 1;
    }
    if (!cmd || !creates(cmd)) exec_runc(argv);
    const char *bundle = p.bundle;
    if (scan_config(bundle) == 1) { /* unreadable: runc says so */
        char abs_bundle[4096];
        if (bundle[0] != '/' && realpath(bundle, abs_bundle)) bundle = abs_bundle; /* the server has another cwd */
        int rc = ask_server(bundle, p.log, p.log_format);
        if (rc > 0) return rc;
        if (rc == 0) exec_runc(argv);
        pid_t pid = fork();
        if (pid < 0) { perror("gpuprov-runtime: fork"); return 1; }
        if (pid == 0) {
            /* A fixed, minimal environment: nothing from the caller (or the image) reaches the editor. */
            char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8", NULL, NULL};
            const char *cfg = getenv("GPUPROV_RUNTIME_CONFIG");
            char cfgvar[4200];
            if (cfg && strlen(cfg) < 4096) {
                snprintf(cfgvar, sizeof cfgvar, "GPUPROV_RUNTIME_CONFIG=%s", cfg);
                envp[2] = cfgvar;
            }
            execle(gpuprov_slot_python, gpuprov_slot_python, "-I", "-S", gpuprov_slot_modify, bundle, p.log,
                   p.log_format, "--spawn-server", (char *)NULL, envp);
            fprintf(stderr, "gpuprov-runtime: cannot exec %s: %s\n", gpuprov_slot_python, strerror(errno));
            _exit(127);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    exec_runc(argv);
    return 127;
}
