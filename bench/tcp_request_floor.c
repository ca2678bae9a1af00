/* bench/tcp_request_floor.c: the peer for bench/qos. What a bare TCP request and answer costs on
 * this host, alone and beside multirail's bulk, with no engine in the way: a client sends a
 * SIZE-byte request on one loopback TCP connection (TCP_NODELAY), a server in another process
 * reads it whole and answers with 24 bytes (a response header's size), and the client times
 * each request from its send to the answer, as `multirail bench` times a HIGH write from
 * submit to completion. Both ends block in recv, as the engine's threads do. It has no QoS of
 * its own: beside bulk it shows what the operating system alone leaves a request/response,
 * the floor an engine's priorities start from.
 *
 *   tcp_request_floor SIZE SECONDS   prints JSON: requests, p50_us, p99_us, max_us
 *
 * Build: cc -O2 -o tcp_request_floor bench/tcp_request_floor.c (bench/qos does).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ANSWER 24

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
  double d = *(const double *)a - *(const double *)b;
  return d < 0 ? -1 : d > 0;
}

/* Blocks until `len` bytes are in `buf`; 0 once the peer closed or the socket failed. */
static int recv_all(int fd, char *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = recv(fd, buf + got, len - got, 0);
    if (n <= 0) return 0;
    got += (size_t)n;
  }
  return 1;
}

static int send_all(int fd, const char *buf, size_t len) {
  size_t sent = 0;
  while (sent < len) {
    ssize_t n = send(fd, buf + sent, len - sent, MSG_NOSIGNAL);
    if (n <= 0) return 0;
    sent += (size_t)n;
  }
  return 1;
}

int main(int argc, char **argv) {
  long size = argc > 1 ? atol(argv[1]) : 0;
  double seconds = argc > 2 ? atof(argv[2]) : 0;
  if (size < 1 || size > (64L << 20) || seconds <= 0) {
    fprintf(stderr, "usage: tcp_request_floor SIZE(1..64MiB) SECONDS(>0)\n");
    return 2;
  }
  int one = 1;
  int l = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (l < 0 || bind(l, (void *)&a, al) || listen(l, 1) || getsockname(l, (void *)&a, &al)) {
    perror("listening on loopback");
    return 1;
  }
  char *buf = malloc((size_t)size);
  if (!buf) return 1;
  memset(buf, 0xA5, (size_t)size);
  pid_t server = fork();
  if (server < 0) {
    perror("fork");
    return 1;
  }
  if (server == 0) {
    int s = accept(l, NULL, NULL);
    if (s < 0) _exit(1);
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (recv_all(s, buf, (size_t)size) && send_all(s, buf, ANSWER)) {
    }
    _exit(0);
  }
  close(l);
  int c = socket(AF_INET, SOCK_STREAM, 0);
  if (c < 0 || connect(c, (void *)&a, al)) {
    perror("connecting");
    kill(server, SIGKILL);
    return 1;
  }
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  size_t cap = 1 << 22, n = 0;
  double *lat = malloc(cap * sizeof(double));
  char answer[ANSWER];
  if (!lat) return 1;
  double end = now_us() + seconds * 1e6;
  while (n < cap) {
    double t0 = now_us();
    if (t0 >= end) break;
    if (!send_all(c, buf, (size_t)size) || !recv_all(c, answer, ANSWER)) {
      fprintf(stderr, "the server went away\n");
      kill(server, SIGKILL);
      return 1;
    }
    lat[n++] = now_us() - t0;
  }
  close(c);
  waitpid(server, NULL, 0);
  if (n == 0) return 1;
  qsort(lat, n, sizeof(double), cmp);
  printf("{\"size\": %ld, \"requests\": %zu, \"p50_us\": %.1f, \"p99_us\": %.1f, \"max_us\": %.1f}\n",
         size, n, lat[n / 2], lat[(size_t)((n - 1) * 0.99 + 0.5)], lat[n - 1]);
  return 0;
}
