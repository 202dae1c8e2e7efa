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
 * starts; a GPU create asks the warm editor there too (ask_editor) and execs runc on its plain "edited" answer. Any
 * other case (an error, a refusal, a warning to print, no trusted editor, no command) jumps to the C library's own
 * entry (_start) with the stack as the kernel left it, and main() goes on: it decides everything again with the same
 * helpers (parse, scan_config), and reports the editor's answer the fast path kept (`asked`) instead of asking again.
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
/* The same with up to six arguments (sendto, getsockopt, ppoll, newfstatat). */
PRELIBC static long raw_syscall6(long n, long a, long b, long c, long d, long e, long f) {
#if defined(__x86_64__)
    long r;
    register long r10 __asm__("r10") = d, r8 __asm__("r8") = e, r9 __asm__("r9") = f;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return r;
#else
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c,
                  x3 __asm__("x3") = d, x4 __asm__("x4") = e, x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
#endif
}
#define RAW_OPEN(path) ((int)raw_syscall(SYS_openat, AT_FDCWD, (long)(path), O_RDONLY | O_CLOEXEC))
#define RAW_READ(fd, buf, n) raw_syscall(SYS_read, (fd), (long)(buf), (long)(n))
#define RAW_FSTAT(fd, st) raw_syscall(SYS_fstat, (fd), (long)(st), 0)
#define RAW_CLOSE(fd) raw_syscall(SYS_close, (fd), 0, 0)
#define RAW_LSTAT(path, st) raw_syscall6(SYS_newfstatat, AT_FDCWD, (long)(path), (long)(st), AT_SYMLINK_NOFOLLOW, 0, 0)
#define RAW_STAT(path, st) raw_syscall6(SYS_newfstatat, AT_FDCWD, (long)(path), (long)(st), 0, 0, 0)
#define RAW_GETEUID() ((unsigned)raw_syscall(SYS_geteuid, 0, 0, 0))
#define RAW_SOCKET(d, t, p) raw_syscall(SYS_socket, (d), (t), (p))
#define RAW_CONNECT(fd, addr, n) raw_syscall(SYS_connect, (fd), (long)(addr), (long)(n))
#define RAW_GETSOCKOPT(fd, lv, opt, v, n) raw_syscall6(SYS_getsockopt, (fd), (lv), (opt), (long)(v), (long)(n), 0)
#define RAW_SEND(fd, buf, n) raw_syscall6(SYS_sendto, (fd), (long)(buf), (long)(n), MSG_NOSIGNAL, 0, 0)
#define RAW_PPOLL(pfd, ts) raw_syscall6(SYS_ppoll, (long)(pfd), 1, (long)(ts), 0, 8, 0)
#define RAW_CLOCK(ts) raw_syscall(SYS_clock_gettime, CLOCK_MONOTONIC, (long)(ts), 0)
#define RAW_WRITE(fd, buf, n) raw_syscall(SYS_write, (fd), (long)(buf), (long)(n))
#else /* no fast path: the C library's own calls, failures as -errno like the raw ones */
static long neg_errno(long r) { return r < 0 ? -errno : r; }
#define RAW_OPEN(path) open((path), O_RDONLY | O_CLOEXEC)
#define RAW_READ(fd, buf, n) neg_errno(read((fd), (buf), (n)))
#define RAW_FSTAT(fd, st) fstat((fd), (st))
#define RAW_CLOSE(fd) close(fd)
#define RAW_LSTAT(path, st) neg_errno(lstat((path), (st)))
#define RAW_STAT(path, st) neg_errno(stat((path), (st)))
#define RAW_GETEUID() ((unsigned)geteuid())
#define RAW_SOCKET(d, t, p) neg_errno(socket((d), (t), (p)))
#define RAW_CONNECT(fd, addr, n) neg_errno(connect((fd), (const struct sockaddr *)(addr), (n)))
#define RAW_GETSOCKOPT(fd, lv, opt, v, n) neg_errno(getsockopt((fd), (lv), (opt), (v), (n)))
#define RAW_SEND(fd, buf, n) neg_errno(send((fd), (buf), (n), MSG_NOSIGNAL))
#define RAW_PPOLL(pfd, ts) neg_errno(ppoll((pfd), 1, (ts), NULL))
#define RAW_CLOCK(ts) clock_gettime(CLOCK_MONOTONIC, (ts))
#define RAW_WRITE(fd, buf, n) neg_errno(write((fd), (buf), (n)))
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
    /* The triggers' first bytes: the scan looks for a trigger only where one could start. An engine's config.json is
     * 10-30 kB (Docker's embeds its seccomp profile), read on every create: trying each trigger at every byte cost
     * ~6 us a kB here. */
    unsigned char first[256];
    for (int c = 0; c < 256; c++) { first[c] = 0; __asm__(""); } /* not a memset call */
    for (int t = 0; triggers[t][0]; t++) first[(unsigned char)triggers[t][0]] = 1;
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
        while (i < upto && buf[i] && !(first[(unsigned char)buf[i]] && (hit = trigger_at(buf + i, have - i)))) i++;
        if (hit || i < upto || last) break; /* a match, a NUL byte, or the end */
        for (long j = upto; j < have; j++) { buf[j - upto] = buf[j]; __asm__(""); } /* not a memmove call */
        have -= upto;
    }
    RAW_CLOSE(fd);
    return hit;
}

/* --- Asking the warm editor (provision/inject/server.py): one exchange per process, from the fast path or main() ---
 * A GPU create asks before the C library starts too (the ~0.3 ms of its start-up was a third of gpuprov's own part
 * of a GPU create on the lent H100: bench/create_split.py). The fast path runs ask_editor and execs runc itself
 * on an "edited" answer (edited_reply: "0\t", its warnings, "\n"); any other outcome is kept in `asked` and main()
 * reports it and goes on exactly as when it asked itself: one set of checks, one exchange, never a second request. */
enum ask_status { ASK_NOT_YET, ASK_REPLY, ASK_ABSENT, ASK_UNTRUSTED, ASK_NO_CONNECT, ASK_PEER, ASK_TOO_LONG,
                  ASK_TIMEOUT, ASK_HUNG_UP };
static struct {
    int status;               /* ask_status */
    const char *why;          /* ASK_UNTRUSTED: why the socket is not trusted */
    int peer_uid;             /* ASK_PEER: who serves the socket */
    struct sockaddr_un addr;  /* the socket asked (zeroed: bss) */
    char req[12400];
    char reply[4096];         /* the editor's line, NUL-terminated (bss: zero) */
} asked;

/* The warm editor's socket: next to GPUPROV_RUNTIME_CONFIG (`cfg`, may be NULL) when that is set. */
PRELIBC static void editor_socket(const char *cfg, char *out, long n) {
    static const char dflt[] = "/run/gpuprov/runtime-editor.sock", ext[] = ".sock";
    long len = 0;
    while (cfg && cfg[len]) { len++; __asm__(""); } /* not a strlen call */
    long k = 0;
    if (cfg && len < n - 6) {
        for (; k < len; k++) { out[k] = cfg[k]; __asm__(""); }
        for (long j = 0; j < (long)sizeof ext; j++) { out[k + j] = ext[j]; __asm__(""); }
    } else {
        for (; k < (long)sizeof dflt; k++) { out[k] = dflt[k]; __asm__(""); }
    }
}

/* Trust the socket only if nobody but us (root) could have made it: the socket and its directory are ours, the socket
 * has no group/other access, the directory no group/other write. NULL: trusted; "": no socket (no editor yet, the
 * quiet, common case); else why not. */
PRELIBC static const char *socket_distrust(const char *path, unsigned me) {
    struct stat st, dst;
    if (RAW_LSTAT(path, &st) != 0) return "";
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    long k = 0, slash = -1;
    for (; path[k] && k < (long)sizeof dir - 1; k++) { dir[k] = path[k]; if (path[k] == '/') slash = k; __asm__(""); }
    dir[k] = 0;
    if (slash == 0) dir[1] = 0;
    else if (slash > 0) dir[slash] = 0;
    else dir[0] = '.', dir[1] = 0;
    if (!S_ISSOCK(st.st_mode)) return "not a socket";
    if (st.st_uid != me) return "owned by another user";
    if (st.st_mode & 077) return "open to group or others";
    if (RAW_STAT(dir, &dst) != 0 || dst.st_uid != me || (dst.st_mode & 022)) return "its directory is not root's alone";
    return NULL;
}

PRELIBC static long now_ms(void) {
    struct timespec ts;
    if (RAW_CLOCK(&ts) != 0) return 0;
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* Send the request and read one reply line within REPLY_TIMEOUT_S: ASK_REPLY, ASK_TIMEOUT or ASK_HUNG_UP. */
PRELIBC static int exchange(int fd, const char *req, long len, char *reply, long cap) {
    long deadline = now_ms() + REPLY_TIMEOUT_S * 1000L, sent = 0, got = 0;
    for (;;) {
        for (long i = 0; i < got; i++) { if (reply[i] == '\n') return ASK_REPLY; __asm__(""); }
        long left = deadline - now_ms();
        if (left <= 0) return ASK_TIMEOUT;
        struct pollfd pfd;
        pfd.fd = fd, pfd.events = sent < len ? POLLOUT : POLLIN, pfd.revents = 0;
        struct timespec ts;
        ts.tv_sec = left / 1000, ts.tv_nsec = (left % 1000) * 1000000L;
        long ready = RAW_PPOLL(&pfd, &ts);
        if (ready == -EINTR) continue;
        if (ready <= 0) return ASK_TIMEOUT;
        long r = sent < len ? RAW_SEND(fd, req + sent, len - sent) : RAW_READ(fd, reply + got, cap - 1 - got);
        if (r == -EAGAIN || r == -EINTR) continue;
        if (r <= 0) return ASK_HUNG_UP; /* hung up: edit directly */
        if (sent < len) { sent += r; continue; }
        got += r;
        if (got >= cap - 1) return ASK_HUNG_UP; /* no line within the buffer: not an editor's answer */
    }
}

/* The one exchange with the warm editor; fills `asked`. Nothing here can block for longer than REPLY_TIMEOUT_S:
 * the connect is non-blocking (a unix socket whose backlog is full, a stopped editor, answers EAGAIN at once). */
PRELIBC static int ask_editor(const char *cfg, const char *bundle, const char *log, const char *log_format) {
    asked.addr.sun_family = AF_UNIX;
    editor_socket(cfg, asked.addr.sun_path, sizeof asked.addr.sun_path);
    unsigned me = RAW_GETEUID();
    asked.why = socket_distrust(asked.addr.sun_path, me);
    if (asked.why) return asked.status = asked.why[0] ? ASK_UNTRUSTED : ASK_ABSENT;
    int fd = (int)RAW_SOCKET(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return asked.status = ASK_NO_CONNECT;
    if (RAW_CONNECT(fd, &asked.addr, sizeof asked.addr) != 0) { RAW_CLOSE(fd); return asked.status = ASK_NO_CONNECT; }
    struct ucred cred;
    socklen_t clen = sizeof cred;
    cred.uid = (uid_t)-1;
    if (RAW_GETSOCKOPT(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != me) {
        asked.peer_uid = (int)cred.uid;
        RAW_CLOSE(fd);
        return asked.status = ASK_PEER;
    }
    const char *fields[3] = {bundle, log, log_format};
    long len = 0;
    for (int f = 0; f < 3; f++) { /* "BUNDLE\tLOG\tFORMAT\n", shorter than the buffer (server.py: MAX_REQUEST) */
        for (const char *c = fields[f]; *c && len < (long)sizeof asked.req; c++) { asked.req[len++] = *c; __asm__(""); }
        if (len >= (long)sizeof asked.req - 1) { RAW_CLOSE(fd); return asked.status = ASK_TOO_LONG; }
        asked.req[len++] = f < 2 ? '\t' : '\n';
    }
    asked.status = exchange(fd, asked.req, len, asked.reply, sizeof asked.reply);
    RAW_CLOSE(fd);
    return asked.status;
}

/* The editor's message from reply[from] (the byte after the rc's tab) to the line's end, newline included, written
 * to stderr; the one printer of both paths (edited_reply, ask_server). The end is the first '\n' exchange() read,
 * not the first NUL: a NUL byte in the line (from a config.json string) is written too. Returns 0 when the reply
 * holds no line end; a failed write (stderr closed) is ignored, as fprintf's was. */
PRELIBC static int say_reply(long from) {
    long nl = from;
    while (nl < (long)sizeof asked.reply - 1 && asked.reply[nl] != '\n') { nl++; __asm__(""); }
    if (asked.reply[nl] != '\n') return 0;
    for (long off = from; nl > from && off <= nl;) { /* an empty message: nothing to say */
        long w = RAW_WRITE(2, asked.reply + off, nl + 1 - off);
        if (w == -EINTR) continue;
        if (w <= 0) break;
        off += w;
    }
    return 1;
}

/* The answer "0\t<warnings>\n": edited. Its warnings (one line; only when the engine passed no --log, else they are
 * in that file and the line is empty) go to stderr as main() prints them (say_reply), in raw writes: a warned start
 * skips the C library's start too (~0.3 ms: a display container on a host without nvidia-modeset is warned at every
 * start). Any other answer: 0, and main() reports it. */
PRELIBC static int edited_reply(void) {
    return asked.reply[0] == '0' && asked.reply[1] == '\t' && say_reply(2);
}

/* The value of NAME in a raw environment (the first, as getenv), or NULL. */
PRELIBC static const char *env_value(char **envp, const char *name) {
    for (; *envp; envp++) {
        const char *e = *envp, *n = name;
        while (*n && *e == *n) e++, n++;
        if (!*n && *e == '=') return e + 1;
    }
    return NULL;
}

#ifdef PRELIBC_ENTRY
/* Called by gpuprov_entry with the kernel's initial stack (argc, argv..., NULL, envp..., NULL). Execs runc when the
 * call needs no edit; returns (and the C library starts, then main()) otherwise. */
PRELIBC __attribute__((used)) void gpuprov_fast(long *sp) {
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1), **envp = argv + argc + 1;
    struct parsed p = parse(argc, argv);
    if (!p.cmd_index) return; /* no command: main() says what (--gpuprov-front-end) */
    if (creates(argv[p.cmd_index])) {
        int need = scan_config(p.bundle);
        if (need < 0) return; /* unreadable: main() lets runc say so */
        if (need) { /* a GPU request */
            if (p.bundle[0] != '/') return; /* main() makes it absolute: the editor has another cwd */
            ask_editor(env_value(envp, "GPUPROV_RUNTIME_CONFIG"), p.bundle, p.log, p.log_format);
            if (!(asked.status == ASK_REPLY && edited_reply())) return; /* main() reports what came back */
        }
    }
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

/* What the warm editor said: its exit code, or -1 when no trusted editor answered in time (then the editor runs
 * directly), each case said on stderr as it was before the fast path asked (one exchange: ask_editor). */
static int ask_server(const char *bundle, const char *log, const char *log_format) {
    if (asked.status == ASK_NOT_YET) ask_editor(getenv("GPUPROV_RUNTIME_CONFIG"), bundle, log, log_format);
    const char *path = asked.addr.sun_path;
    switch (asked.status) {
    case ASK_REPLY: break;
    case ASK_UNTRUSTED:
        fprintf(stderr, "gpuprov-runtime: not trusting the editor socket %s (%s); editing directly\n", path, asked.why);
        return -1;
    case ASK_PEER:
        fprintf(stderr, "gpuprov-runtime: the editor socket %s is served by uid %d, not ours; editing directly\n",
                path, asked.peer_uid);
        return -1;
    case ASK_TIMEOUT:
        fprintf(stderr, "gpuprov-runtime: the warm editor did not answer within %d s; editing directly\n",
                REPLY_TIMEOUT_S);
        return -1;
    default: return -1; /* no editor yet, no connection, a request too long, or it hung up: edit directly */
    }
    const char *resp = asked.reply;
    char *end;
    long rc = strtol(resp, &end, 10);
    if (end == resp || (*end != '\t' && *end != '\n') || rc < 0 || rc > 255) return -1; /* not an editor's answer */
    if (*end == '\t') say_reply(end + 1 - asked.reply);
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
    /* Asked already before the C library started: config.json was scanned then (and is edited by now). */
    if (asked.status != ASK_NOT_YET || scan_config(bundle) == 1) { /* unreadable: runc says so */
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
