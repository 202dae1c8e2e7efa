/* bench/exec_hop.c (issue 41): runc after a fixed delay on `create`, nothing else. runtime_bench times it on the
 * limit's own config, so a wait of the front-end's length is measured apart from the editor's work: if a start
 * through this hop costs its limit + the delay, a wait is additive on that host and whatever gpuprov adds beyond its
 * own part (bench/create_split.py) comes from the editor; if it costs more, any wait before runc costs more there.
 *   HOP_US=N      the delay in microseconds (0: none, just the extra exec)
 *   HOP_MODE=spin the CPU kept busy through the delay (clock_gettime in a loop); else nanosleep, as the front-end
 *                 sleeps in ppoll on the editor's reply
 *   HOP_RUNC=PATH the runc to exec (default: runc on PATH)
 * Build (static, so it starts without the dynamic loader, as the front-end does): cc -O2 -static exec_hop.c */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *runc = getenv("HOP_RUNC"), *us_s = getenv("HOP_US"), *mode = getenv("HOP_MODE");
    long us = us_s ? atol(us_s) : 0;
    int create = 0;
    for (int i = 1; i < argc; i++) create |= strcmp(argv[i], "create") == 0;
    if (create && us > 0) {
        if (mode && strcmp(mode, "spin") == 0) {
            long long end = now_ns() + us * 1000LL;
            while (now_ns() < end) {}
        } else {
            struct timespec ts = {us / 1000000, (us % 1000000) * 1000L};
            while (nanosleep(&ts, &ts) != 0) {}
        }
    }
    runc = runc ? runc : "runc";
    argv[0] = (char *)runc;
    execvp(runc, argv);
    perror(runc);
    return 127;
}
