/* gpuprov-runtime, compiled front-end.  Same contract as provision/inject/shim.py:
 *   - every runc command except `create` (and `run`, which creates) is exec'd into runc at once (no parsing, no allocation);
 *   - `create` reads the bundle's config.json; only when it mentions a GPU request does it run the Python
 *     editor (isolated interpreter, fixed minimal environment), then exec runc.
 * Paths are fixed at build time (gpuprov runtime install):
 *   -DRUNC=\"/usr/sbin/runc\" -DPYTHON=\"/usr/bin/python3\" -DMODIFY=\".../provision/inject/modify_main.py\"
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *value_opts[] = {"--root", "--log", "--log-format", "--criu", "--rootless", NULL};
/* Strings whose presence means the Python editor must look (it decides precisely; this only filters). */
static const char *triggers[] = {"NVIDIA_VISIBLE_DEVICES=", "nvidia-container-runtime-hook",
                                 "/var/run/nvidia-container-devices/", "GPUPROV_GPU_", "ALIYUN_COM_GPU_", NULL};

static void exec_runc(char **argv) {
    argv[0] = RUNC;
    execv(RUNC, argv);
    fprintf(stderr, "gpuprov-runtime: cannot exec %s: %s\n", RUNC, strerror(errno));
    _exit(127);
}

static int is_value_opt(const char *a) {
    for (int i = 0; value_opts[i]; i++)
        if (strcmp(a, value_opts[i]) == 0) return 1;
    return 0;
}

static int needs_edit(const char *bundle) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", bundle);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* let runc report the error */
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) { close(fd); return 0; }
    char *buf = malloc(st.st_size + 1);
    ssize_t n = buf ? read(fd, buf, st.st_size) : -1;
    close(fd);
    if (n <= 0) { free(buf); return 0; }
    buf[n] = 0;
    int hit = 0;
    for (int i = 0; triggers[i] && !hit; i++) hit = strstr(buf, triggers[i]) != NULL;
    free(buf);
    return hit;
}

/* The warm editor's socket (provision/inject/server.py): next to GPUPROV_RUNTIME_CONFIG when that is set. */
static void socket_path(char *out, size_t n) {
    const char *cfg = getenv("GPUPROV_RUNTIME_CONFIG");
    if (cfg && strlen(cfg) < n - 6) snprintf(out, n, "%s.sock", cfg);
    else snprintf(out, n, "%s", "/run/gpuprov/runtime-editor.sock");
}

/* Ask the warm editor: returns its exit code, or -1 when none answers (then the editor runs directly). */
static int ask_server(const char *bundle, const char *log, const char *log_format) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    socket_path(addr.sun_path, sizeof addr.sun_path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) { close(fd); return -1; }
    char req[12400];
    int len = snprintf(req, sizeof req, "%s\t%s\t%s\n", bundle, log, log_format);
    if (len <= 0 || (size_t)len >= sizeof req || write(fd, req, len) != len) { close(fd); return -1; }
    char resp[4096] = {0};
    ssize_t got = 0, r;
    while (got < (ssize_t)sizeof resp - 1 && (r = read(fd, resp + got, sizeof resp - 1 - got)) > 0) {
        got += r;
        if (memchr(resp, '\n', got)) break;
    }
    close(fd);
    if (got <= 0) return -1;
    char *msg = strchr(resp, '\t'); /* "RC\tMESSAGE\n": the editor's one-line refusal, for our stderr */
    if (msg && msg[1] && msg[1] != '\n') fprintf(stderr, "%s", msg + 1);
    return atoi(resp);
}

int main(int argc, char **argv) {
    int i = 1;
    const char *cmd = NULL;
    while (i < argc) {
        if (is_value_opt(argv[i])) { i += 2; continue; }
        if (argv[i][0] == '-') { i++; continue; }
        cmd = argv[i];
        break;
    }
    if (!cmd || (strcmp(cmd, "create") != 0 && strcmp(cmd, "run") != 0)) exec_runc(argv);
    const char *bundle = ".", *log = "", *log_format = "";
    for (int j = 1; j < i; j++) {
        if (strcmp(argv[j], "--log") == 0 && j + 1 < i) log = argv[j + 1];
        else if (strncmp(argv[j], "--log=", 6) == 0) log = argv[j] + 6;
        else if (strcmp(argv[j], "--log-format") == 0 && j + 1 < i) log_format = argv[j + 1];
        else if (strncmp(argv[j], "--log-format=", 13) == 0) log_format = argv[j] + 13;
    }
    for (int j = i + 1; j < argc; j++) {
        if ((strcmp(argv[j], "--bundle") == 0 || strcmp(argv[j], "-b") == 0) && j + 1 < argc) bundle = argv[j + 1];
        else if (strncmp(argv[j], "--bundle=", 9) == 0) bundle = argv[j] + 9;
    }
    if (needs_edit(bundle)) {
        char abs_bundle[4096];
        if (bundle[0] != '/' && realpath(bundle, abs_bundle)) bundle = abs_bundle; /* the server has another cwd */
        int rc = ask_server(bundle, log, log_format);
        if (rc > 0) return rc;
        if (rc == 0) exec_runc(argv);
        pid_t pid = fork();
        if (pid < 0) { perror("gpuprov-runtime: fork"); return 1; }
        if (pid == 0) {
            /* A fixed, minimal environment: nothing from the caller (or the image) reaches the editor. */
            char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8", NULL};
            const char *cfg = getenv("GPUPROV_RUNTIME_CONFIG");
            char cfgvar[4200];
            if (cfg && strlen(cfg) < 4096) {
                snprintf(cfgvar, sizeof cfgvar, "GPUPROV_RUNTIME_CONFIG=%s", cfg);
                envp[1] = cfgvar;
            }
            execle(PYTHON, PYTHON, "-I", "-S", MODIFY, bundle, log, log_format, "--spawn-server", (char *)NULL, envp);
            fprintf(stderr, "gpuprov-runtime: cannot exec %s: %s\n", PYTHON, strerror(errno));
            _exit(127);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    exec_runc(argv);
    return 127;
}
