/* The floor of a request answered after a pause, on this machine: two processes, one unix
 * stream socket, a 64-byte request and a 160-byte answer, nothing else. The client sleeps
 * `pause` seconds before each request, as an agent waits for its model, then times its send
 * to the answer's last byte; the server blocks in recv and answers at once. Two clients take
 * turns, round by round: one blocks in recv for the answer, one polls for it (recv without
 * waiting, then sched_yield) for up to 2 ms first, as jukebox.booth.control's client does.
 * Whatever a checkpoint does on top of this is the booth's own cost; this part is the
 * kernel's and the hypervisor's (the wake-ups of idle, halted vCPUs).
 *
 * Usage: wakeup_floor ROUNDS PAUSE_SECONDS; prints {"block": [us...], "poll": [us...]}.
 * Built and run by bench/bench_booth.py. */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define POLL_US 2000.0

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void serve(int fd) {
    char buf[256], out[160];
    memset(out, 'a', sizeof out);
    out[sizeof out - 1] = '\n';
    for (;;) {
        if (recv(fd, buf, sizeof buf, 0) <= 0)
            _exit(0);
        if (send(fd, out, sizeof out, MSG_NOSIGNAL) != (ssize_t)sizeof out)
            _exit(1);
    }
}

/* One request and its whole answer, in microseconds; -1 if the server is gone. */
static double ask(int fd, int poll) {
    char req[64], buf[256];
    memset(req, 'r', sizeof req);
    req[sizeof req - 1] = '\n';
    size_t have = 0;
    double t0 = now_us();
    if (send(fd, req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        return -1;
    while (have < 160) {
        ssize_t n;
        if (poll && now_us() - t0 < POLL_US) {
            n = recv(fd, buf + have, sizeof buf - have, MSG_DONTWAIT);
            if (n < 0) {
                sched_yield();
                continue;
            }
        } else {
            n = recv(fd, buf + have, sizeof buf - have, 0);
        }
        if (n <= 0)
            return -1;
        have += (size_t)n;
    }
    return now_us() - t0;
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    int rounds = atoi(argv[1]);
    double pause = atof(argv[2]);
    if (rounds < 1 || rounds > 10000 || pause < 0 || pause > 10)
        return 2;
    int fds[2];
    pid_t servers[2];
    for (int v = 0; v < 2; v++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
            return 1;
        if ((servers[v] = fork()) == 0) {
            close(sv[0]);
            for (int u = 0; u < v; u++)
                close(fds[u]); /* else the first server never sees its client's end */
            serve(sv[1]);
        }
        close(sv[1]);
        fds[v] = sv[0];
    }
    double *t = calloc(2 * (size_t)rounds, sizeof(double));
    struct timespec ps = {(time_t)pause, (long)((pause - (time_t)pause) * 1e9)};
    int failed = t == NULL;
    for (int r = -2; r < rounds && !failed; r++) /* two rounds to start with, not counted */
        for (int v = 0; v < 2 && !failed; v++) {
            nanosleep(&ps, NULL);
            double d = ask(fds[v], v);
            failed = d < 0;
            if (r >= 0)
                t[v * rounds + r] = d;
        }
    for (int v = 0; v < 2; v++) {
        close(fds[v]);
        waitpid(servers[v], NULL, 0);
    }
    if (failed)
        return 1;
    for (int v = 0; v < 2; v++) {
        printf(v == 0 ? "{\"block\": [" : "], \"poll\": [");
        for (int r = 0; r < rounds; r++)
            printf(r ? ", %.1f" : "%.1f", t[v * rounds + r]);
    }
    printf("]}\n");
    free(t);
    return 0;
}
