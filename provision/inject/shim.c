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
#include <sys/stat.h>
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
            execle(PYTHON, PYTHON, "-I", "-S", MODIFY, bundle, log, log_format, (char *)NULL, envp);
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
