/* bench/tcp_stream_floor.c: the bare TCP stream with an engine's working set, the peer beside
 * iperf3 in bench/small. iperf3 sends one buffer of at most 1 MiB over and over, so its sender
 * copies from cache; an engine moving a KV cache or weights reads every byte from memory once.
 * Here a sender process walks a SIZE-byte buffer in CHUNK-byte writes and a receiver process
 * walks its own SIZE-byte buffer in CHUNK-byte reads (both buffers touched before the clock
 * starts), over CONNS loopback TCP connections, each with a sending and a receiving thread of
 * its own, as the engine's tcp rail runs `transports.tcp.connections_per_rail` connections.
 * No framing, no answers, no engine: what the kernel alone moves from memory to memory.
 *
 *   tcp_stream_floor SIZE CHUNK CONNS SECONDS   prints JSON: bytes, seconds, gb_per_s
 *
 * SIZE and CHUNK in bytes (SIZE a multiple of CONNS * CHUNK). Build: cc -O2 -pthread -o
 * tcp_stream_floor bench/tcp_stream_floor.c (bench/small does).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 64

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

struct worker {
  int fd;
  char *base; /* this connection's share of the buffer */
  size_t share;
  size_t chunk;
  double deadline; /* sender only */
  uint64_t bytes;
};

static char *touched_buffer(size_t size) {
  char *b = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  memset(b, 0x5a, size);
  return b;
}

static void *send_loop(void *arg) {
  struct worker *w = arg;
  size_t off = 0;
  while (now_s() < w->deadline) {
    ssize_t n = send(w->fd, w->base + off, w->chunk, 0);
    if (n <= 0) {
      perror("send");
      exit(1);
    }
    w->bytes += (uint64_t)n;
    off += (size_t)n;
    if (off + w->chunk > w->share) off = 0;
  }
  shutdown(w->fd, SHUT_WR);
  return NULL;
}

static void *recv_loop(void *arg) {
  struct worker *w = arg;
  size_t off = 0;
  for (;;) {
    ssize_t n = recv(w->fd, w->base + off, w->chunk, 0);
    if (n < 0) {
      perror("recv");
      exit(1);
    }
    if (n == 0) break;
    w->bytes += (uint64_t)n;
    off += (size_t)n;
    if (off + w->chunk > w->share) off = 0;
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: tcp_stream_floor SIZE CHUNK CONNS SECONDS\n");
    return 2;
  }
  size_t size = strtoull(argv[1], NULL, 10), chunk = strtoull(argv[2], NULL, 10);
  int conns = atoi(argv[3]);
  double seconds = atof(argv[4]);
  if (conns < 1 || conns > MAX_CONNS || chunk == 0 || size < chunk * (size_t)conns ||
      seconds <= 0) {
    fprintf(stderr, "tcp_stream_floor: need 1 <= CONNS <= %d, CHUNK >= 1, SIZE >= CONNS * CHUNK, "
                    "SECONDS > 0\n", MAX_CONNS);
    return 2;
  }
  size_t share = size / (size_t)conns;

  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, MAX_CONNS) ||
      getsockname(lfd, (struct sockaddr *)&a, &alen)) {
    perror("listen");
    return 1;
  }
  int ready[2];
  if (pipe(ready)) {
    perror("pipe");
    return 1;
  }
  pid_t child = fork();
  if (child == 0) {
    /* Receiver: accepts CONNS connections, says it is ready, reads until every sender shuts. */
    close(ready[0]);
    char *buf = touched_buffer(size);
    struct worker w[MAX_CONNS];
    pthread_t t[MAX_CONNS];
    for (int i = 0; i < conns; i++) {
      int fd = accept(lfd, NULL, NULL);
      if (fd < 0) {
        perror("accept");
        _exit(1);
      }
      w[i] = (struct worker){.fd = fd, .base = buf + share * i, .share = share, .chunk = chunk};
    }
    if (write(ready[1], "r", 1) != 1) _exit(1);
    for (int i = 0; i < conns; i++) pthread_create(&t[i], NULL, recv_loop, &w[i]);
    for (int i = 0; i < conns; i++) pthread_join(t[i], NULL);
    _exit(0);
  }
  close(ready[1]);
  char *buf = touched_buffer(size);
  struct worker w[MAX_CONNS];
  pthread_t t[MAX_CONNS];
  for (int i = 0; i < conns; i++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
      perror("connect");
      kill(child, SIGKILL);
      return 1;
    }
    w[i] = (struct worker){.fd = fd, .base = buf + share * i, .share = share, .chunk = chunk};
  }
  char c;
  if (read(ready[0], &c, 1) != 1) {
    fprintf(stderr, "tcp_stream_floor: receiver failed\n");
    return 1;
  }
  double start = now_s();
  for (int i = 0; i < conns; i++) {
    w[i].deadline = start + seconds;
    pthread_create(&t[i], NULL, send_loop, &w[i]);
  }
  uint64_t bytes = 0;
  for (int i = 0; i < conns; i++) {
    pthread_join(t[i], NULL);
    bytes += w[i].bytes;
  }
  int status = 0;
  waitpid(child, &status, 0);
  double elapsed = now_s() - start;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "tcp_stream_floor: receiver failed\n");
    return 1;
  }
  printf("{\"bytes\": %llu, \"seconds\": %.6f, \"gb_per_s\": %.4f}\n", (unsigned long long)bytes,
         elapsed, bytes / elapsed / 1e9);
  return 0;
}
