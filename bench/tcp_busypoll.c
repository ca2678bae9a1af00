/* bench/tcp_busypoll.c: the floor for TCP message latency on this host. A client and a server
 * exchange fixed-size messages over one TCP connection (TCP_NODELAY), each side busy polling
 * recv(MSG_DONTWAIT) until the whole message is in: no wake-up, no thread hand-off, nothing
 * but the system calls a message costs. multirail's tcp lanes are compared against it.
 *
 *   tcp_busypoll server PORT SIZE [two]          answers every SIZE-byte message with one
 *   tcp_busypoll client HOST PORT SIZE N W [two]  N measured round trips after W warm-up ones;
 *                                                 prints JSON: one-way median and p99 in µs
 *
 * With `two` (both ends), requests go on one connection and answers on a second, as
 * multirail's message lanes did before duplex dedicated lanes (one socket per sending
 * direction): then no answer carries the acknowledgement of its request, and the round trip
 * pays for pure ACK segments. On this 2-core VM that alone costs ~1 µs one-way (2.9 -> 3.6-4.1
 * µs). multirail's dedicated tcp lanes now share one socket both ways (messaging::duplex).
 *
 * Build: cc -O2 -o tcp_busypoll bench/tcp_busypoll.c (bench/latency does).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Busy polls until `len` bytes are in `buf`; 0 once the peer closed before any byte. */
static int recv_all(int fd, char *buf, size_t len) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = recv(fd, buf + got, len - got, MSG_DONTWAIT);
        if (n > 0) {
            got += (size_t)n;
        } else if (n == 0) {
            if (got == 0) return 0;
            fprintf(stderr, "peer closed inside a message\n");
            exit(1);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            die("recv");
        }
    }
    return 1;
}

static void send_all(int fd, const char *buf, size_t len) {
    size_t sent = 0;
    while (sent < len) {
        ssize_t n = send(fd, buf + sent, len - sent, MSG_NOSIGNAL);
        if (n > 0) {
            sent += (size_t)n;
        } else if (errno != EAGAIN && errno != EINTR) {
            die("send");
        }
    }
}

static void nodelay(int fd) {
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) die("TCP_NODELAY");
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int serve(int port, size_t size, int two) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0) die("socket");
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) != 0) die("bind");
    if (listen(l, 1) != 0) die("listen");
    printf("ready\n");
    fflush(stdout);
    int fd = accept(l, NULL, NULL);
    if (fd < 0) die("accept");
    nodelay(fd);
    int out = fd;
    if (two) {
        out = accept(l, NULL, NULL);
        if (out < 0) die("accept");
        nodelay(out);
    }
    char *buf = malloc(size);
    while (recv_all(fd, buf, size)) send_all(out, buf, size);
    return 0;
}

static int connect_to(struct sockaddr_in *a) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    if (connect(fd, (struct sockaddr *)a, sizeof *a) != 0) die("connect");
    nodelay(fd);
    return fd;
}

static int client(const char *host, int port, size_t size, long n, long warm, int two) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) die("inet_pton");
    int fd = connect_to(&a);
    int in = two ? connect_to(&a) : fd;
    char *buf = calloc(1, size);
    uint64_t *rtt = malloc(sizeof *rtt * (size_t)n);
    for (long i = 0; i < warm + n; i++) {
        uint64_t t0 = now_ns();
        send_all(fd, buf, size);
        if (!recv_all(in, buf, size)) {
            fprintf(stderr, "server closed\n");
            return 1;
        }
        if (i >= warm) rtt[i - warm] = now_ns() - t0;
    }
    qsort(rtt, (size_t)n, sizeof *rtt, cmp_u64);
    double p50 = rtt[n / 2] / 2000.0, p99 = rtt[(n * 99) / 100] / 2000.0;
    printf("{\"bytes\": %zu, \"iterations\": %ld, \"t_typical_us\": %.3f, \"p99_us\": %.3f}\n",
           size, n, p50, p99);
    return 0;
}

int main(int argc, char **argv) {
    int two = strcmp(argv[argc - 1], "two") == 0;
    if (argc == 4 + two && strcmp(argv[1], "server") == 0)
        return serve(atoi(argv[2]), (size_t)atol(argv[3]), two);
    if (argc == 7 + two && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), (size_t)atol(argv[4]), atol(argv[5]), atol(argv[6]),
                      two);
    fprintf(stderr, "usage: %s server PORT SIZE [two] | client HOST PORT SIZE N WARMUP [two]\n",
            argv[0]);
    return 2;
}
