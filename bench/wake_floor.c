/* bench/wake_floor.c: the floor of "the first message after a silence" on this host, for
 * bench/idle. A client thread sends a 128-byte message, then busy-polls for the answer; a
 * server thread asleep in epoll_wait wakes, reads it and answers. Nothing else runs: no
 * engine, no buffers, a few cache lines. Three modes, as multirail's lanes carry a message:
 *   eventfd  the message is an eventfd write (how an shm sender rings a sleeping receiver)
 *   tcp      one loopback TCP connection, TCP_NODELAY, 128 bytes each way
 *   memory   a counter stored into a shared cache line each way, read by a polling peer (how
 *            an shm ring carries a message to a receiver that polls; with `poll` or `wake`
 *            only: nothing sleeps on memory, that is what the eventfd is for)
 * It measures WARM busy round trips (the server then polls too), then N round trips each after
 * GAP_MS of silence, and prints JSON: the busy one-way (half the median busy round trip) and
 * the percentiles of (gap round trip - busy one-way), the same quantity
 * `multirail pingpong --gap-ms` reports as the first message's delivery.
 * With `wake` the server sleeps until WAKE_LEAD_US before the next message is due (GAP_MS after
 * its last answer; timer slack 1 µs), then polls for it: what waking ahead of a steady cadence
 * can reach on this host, the floor of multirail's cadence lead.
 * With `poll` the server never sleeps: it busy polls through the gaps too, so what remains is
 * what a silence costs without any wake-up (caches and, for tcp, the network stack gone cold).
 * The server runs in its own process by default, as `multirail pingpong --local`'s does: on a
 * virtual machine a wake-up that switches address spaces costs more (~1.3 x here) than one
 * between two threads of a process, which `threads` measures.
 * Usage: wake_floor eventfd|tcp|memory [N=300] [GAP_MS=10] [sleep|poll|wake] [procs|threads]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WARM 2000
static int tcp_mode, memory_mode, ping_fd, pong_fd, server_sock;
/* memory mode: the message and its answer, each a counter in its own cache line. */
struct lines {
  volatile uint64_t ping __attribute__((aligned(64)));
  volatile uint64_t pong __attribute__((aligned(64)));
};
static struct lines *lines;
static uint64_t sent, server_seen; /* the client's last count sent; the server's last taken */
/* Shared with a server process: whether it polls (1) or sleeps in epoll_wait (0). */
static volatile int *server_polls;
/* With `wake`: the server sleeps until this long before the next message is due (the gap after
 * its last answer), then polls: the floor of a receiver that anticipates a steady cadence, as
 * multirail's does with transports.<t>.receive.cadence_lead_us (default 200). */
#define WAKE_LEAD_US 200
static int wake_gap_us; /* 0: not in `wake` mode */

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int take(int fd, char *buf) {
  if (memory_mode) {
    (void)buf;
    if (fd == pong_fd) return lines->pong == sent; /* the client: its message answered */
    if (lines->ping == server_seen) return 0;      /* the server: a new message */
    server_seen = lines->ping;
    return 1;
  }
  if (!tcp_mode) {
    uint64_t v;
    return read(fd, &v, 8) == 8;
  }
  return recv(fd, buf, 128, MSG_DONTWAIT) > 0;
}

static void give(int fd, char *buf) {
  if (memory_mode) {
    if (fd == pong_fd)
      lines->pong = server_seen; /* the server answers the count it took */
    else
      lines->ping = ++sent; /* the client sends the next count */
    return;
  }
  if (!tcp_mode) {
    uint64_t one = 1;
    if (write(fd, &one, 8) != 8) abort();
  } else if (send(fd, buf, 128, 0) != 128) {
    abort();
  }
}

static void *server(void *arg) {
  (void)arg;
  char buf[128] = {0};
  int in = tcp_mode ? server_sock : ping_fd, out = tcp_mode ? server_sock : pong_fd;
  int ep = epoll_create1(0);
  struct epoll_event e = {.events = EPOLLIN};
  epoll_ctl(ep, EPOLL_CTL_ADD, in, &e);
  struct timespec due = {0};
  int anticipating = 0;
  for (;;) {
    if (!*server_polls) {
      if (!wake_gap_us) {
        struct epoll_event o;
        epoll_wait(ep, &o, 1, -1);
      } else if (anticipating) {
        /* once per message: sleep until the lead before it is due, then poll */
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL);
        anticipating = 0;
      }
    }
    if (take(in, buf)) {
      give(out, buf);
      if (wake_gap_us && !*server_polls) {
        clock_gettime(CLOCK_MONOTONIC, &due);
        long ns = due.tv_nsec + (long)(wake_gap_us - WAKE_LEAD_US) * 1000;
        due.tv_sec += ns / 1000000000;
        due.tv_nsec = ns % 1000000000;
        anticipating = 1;
      }
    }
  }
  return NULL;
}

static int cmp(const void *a, const void *b) {
  double d = *(const double *)a - *(const double *)b;
  return d < 0 ? -1 : d > 0;
}

static double round_trip(int in, int out, char *buf) {
  double t0 = now_us();
  give(out, buf);
  while (!take(in, buf)) {
  }
  return now_us() - t0;
}

int main(int argc, char **argv) {
  if (argc < 2 || (strcmp(argv[1], "eventfd") && strcmp(argv[1], "tcp") && strcmp(argv[1], "memory"))) {
    fprintf(stderr, "usage: wake_floor eventfd|tcp|memory [N] [GAP_MS] [sleep|poll|wake] [procs|threads]\n");
    return 2;
  }
  tcp_mode = !strcmp(argv[1], "tcp");
  memory_mode = !strcmp(argv[1], "memory");
  int n = argc > 2 ? atoi(argv[2]) : 300, gap_ms = argc > 3 ? atoi(argv[3]) : 10;
  int keep_polling = argc > 4 && !strcmp(argv[4], "poll");
  int wake = argc > 4 && !strcmp(argv[4], "wake");
  int threads = argc > 5 && !strcmp(argv[5], "threads");
  if (n < 1 || gap_ms < 0 || (argc > 4 && !keep_polling && !wake && strcmp(argv[4], "sleep")) ||
      (argc > 5 && !threads && strcmp(argv[5], "procs")) || argc > 6 ||
      (memory_mode && !keep_polling && !wake)) {
    fprintf(stderr, "usage: wake_floor eventfd|tcp|memory [N] [GAP_MS] [sleep|poll|wake] [procs|threads]\n");
    return 2;
  }
  if (wake) {
    wake_gap_us = gap_ms * 1000;
    prctl(PR_SET_TIMERSLACK, 1UL); /* inherited by the server, process or thread */
  }
  server_polls = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (server_polls == MAP_FAILED) return 1;
  lines = mmap(NULL, sizeof *lines, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (lines == MAP_FAILED) return 1;
  *server_polls = 1;
  int client_sock = -1;
  if (tcp_mode) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t al = sizeof a;
    if (bind(l, (void *)&a, al) || listen(l, 1) || getsockname(l, (void *)&a, &al)) return 1;
    client_sock = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(client_sock, (void *)&a, al)) return 1;
    server_sock = accept(l, 0, 0);
    setsockopt(client_sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(server_sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  } else {
    ping_fd = eventfd(0, EFD_NONBLOCK);
    pong_fd = eventfd(0, EFD_NONBLOCK);
  }
  int in = tcp_mode ? client_sock : pong_fd, out = tcp_mode ? client_sock : ping_fd;
  pid_t child = -1;
  if (threads) {
    pthread_t t;
    pthread_create(&t, NULL, server, NULL);
  } else {
    child = fork();
    if (child < 0) return 1;
    if (child == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives the client */
      if (tcp_mode) close(client_sock);
      server(NULL);
      _exit(0);
    }
    if (tcp_mode) close(server_sock);
  }
  char buf[128] = {0};
  double *warm = malloc(WARM * sizeof(double)), *gap = malloc(n * sizeof(double));
  for (int i = 0; i < WARM; i++) warm[i] = round_trip(in, out, buf);
  qsort(warm, WARM, sizeof(double), cmp);
  double busy_one_way = warm[WARM / 2] / 2;
  if (!keep_polling) {
    *server_polls = 0;
    round_trip(in, out, buf); /* the server is now asleep in epoll_wait between messages */
  }
  for (int i = 0; i < n; i++) {
    usleep(gap_ms * 1000);
    double r = round_trip(in, out, buf) - busy_one_way;
    gap[i] = r < 0 ? 0 : r;
  }
  qsort(gap, n, sizeof(double), cmp);
#define AT(p) gap[(int)((n - 1) * (p) + 0.5)]
  if (child > 0) {
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
  }
  printf("{\"mode\": \"%s\", \"shape\": \"%s\", \"server\": \"%s\", \"gap_ms\": %d, \"n\": %d, \"busy_one_way_us\": %.3f, "
         "\"p50_us\": %.2f, \"p90_us\": %.2f, \"p99_us\": %.2f, \"max_us\": %.2f}\n",
         argv[1], threads ? "threads" : "procs", keep_polling ? "polls" : wake ? "wakes" : "sleeps", gap_ms, n, busy_one_way, AT(0.5), AT(0.9), AT(0.99), gap[n - 1]);
  return 0;
}
