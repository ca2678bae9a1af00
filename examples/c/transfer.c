/*
 * transfer.c: the multirail C API end to end, between two processes.
 *
 *   transfer target    [CONFIG_JSON] [LEN]
 *   transfer initiator SEGMENT ADDR LEN [CONFIG_JSON] [ROUNDS]
 *
 * The target starts an engine, allocates LEN bytes (default 1 MiB), prints
 *   SEGMENT <name>
 *   ADDR <address of its buffer>
 *   LEN <bytes>
 * and waits for a notification "done SEED". It then checks that every byte of its buffer
 * holds pattern SEED, opens the sender's segment and answers with the message "ok" (or
 * "bad"), and runs until its standard input closes (the initiator may still use its memory
 * until then), then frees its engine.
 *
 * The initiator opens that segment, writes a pattern into the target's buffer, reads it back
 * into memory of its own (registered with malloc'd memory) and checks every byte; prepares a
 * list of chunks and posts it ROUNDS times (default 3), writing and reading back a new
 * pattern each time; then goes through the error paths (NULL pointers, unknown and freed
 * handles, out-of-range requests, unknown segments), each checked to return its code and a
 * message; finally writes pattern SEED with the notification "done SEED", waits for the
 * target's "ok" and frees its engine.
 *
 * CONFIG_JSON is the engine's configuration, e.g. {"transport":"shm"} or
 * {"transport":"tcp"}; NULL-equivalent "-" means MULTIRAIL_CONF or the defaults.
 *
 * Build: cc -std=c11 -I include examples/c/transfer.c -L target/debug -lmultirail \
 *           -Wl,-rpath,$PWD/target/debug -o transfer
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "multirail.h"

/* The final pattern the initiator writes, announced in its "done" notification. */
#define SEED 77
/* How long either side waits for the other, in milliseconds (valgrind is slow). */
#define PATIENCE_MS 120000
/* Entries of the prepared list. */
#define CHUNKS 8

static const char *role = "?";

/* Fails the program when `call` does not return MULTIRAIL_OK, printing the last error. */
#define CHECK(call)                                                                       \
    do {                                                                                  \
        int32_t rc_ = (call);                                                             \
        if (rc_ != MULTIRAIL_OK) {                                                        \
            fprintf(stderr, "%s: %s:%d: %s returned %d: %s\n", role, __FILE__, __LINE__, \
                    #call, (int)rc_, multirail_last_error());                             \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

/* Fails the program unless `cond` holds. */
#define REQUIRE(cond, ...)                                                   \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s: %s:%d: ", role, __FILE__, __LINE__);        \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
            exit(1);                                                         \
        }                                                                    \
    } while (0)

static int error_paths_checked = 0;

/* Checks that `call` fails with `code` and that the last error is not empty and mentions
 * `word` (NULL: anything). */
#define EXPECT_ERR(call, code, word) expect_err((call), (code), (word), #call, __LINE__)

static void expect_err(int32_t rc, int32_t code, const char *word, const char *what, int line) {
    const char *msg = multirail_last_error();
    REQUIRE(msg != NULL, "line %d: multirail_last_error() returned NULL", line);
    REQUIRE(rc == code, "line %d: %s returned %d, expected %d (%s)", line, what, (int)rc,
            (int)code, msg);
    REQUIRE(msg[0] != '\0', "line %d: %s failed with an empty last error", line, what);
    REQUIRE(word == NULL || strstr(msg, word) != NULL,
            "line %d: %s: the message does not mention \"%s\": %s", line, what, word, msg);
    error_paths_checked++;
}

static uint8_t pattern(uint64_t i, unsigned seed) {
    return (uint8_t)((i * 131u + seed * 29u + (i >> 8) + (i >> 16)) & 0xffu);
}

static void fill_pattern(uint8_t *p, uint64_t len, unsigned seed) {
    for (uint64_t i = 0; i < len; i++) p[i] = pattern(i, seed);
}

/* Returns the index of the first byte that differs from pattern `seed`, or `len`. */
static uint64_t first_mismatch(const uint8_t *p, uint64_t len, unsigned seed) {
    for (uint64_t i = 0; i < len; i++)
        if (p[i] != pattern(i, seed)) return i;
    return len;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static const char *config_arg(const char *s) {
    return (s == NULL || strcmp(s, "-") == 0) ? NULL : s;
}

/* Copies the JSON string value of `"key":"` found in `json` at or after `from` into `out`
 * (segment names and this example's messages have no escapes). Returns the position after
 * it, or NULL. */
static const char *json_field(const char *json, const char *key, char *out, size_t cap) {
    char pat[32];
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *p = strstr(json, pat);
    if (p == NULL) return NULL;
    p += strlen(pat);
    const char *end = strchr(p, '"');
    if (end == NULL || (size_t)(end - p) >= cap) return NULL;
    memcpy(out, p, (size_t)(end - p));
    out[end - p] = '\0';
    return end;
}

/* Waits for a notification whose text starts with `prefix`; copies its text and sender. */
static void wait_notification(multirail_engine_t e, const char *prefix, char *msg, size_t msg_cap,
                              char *from, size_t from_cap) {
    long deadline = now_ms() + PATIENCE_MS;
    while (now_ms() < deadline) {
        size_t needed = 0;
        /* Ask the size first: nothing is lost when the buffer is too small. */
        int32_t rc = multirail_notifications(e, NULL, 0, &needed);
        REQUIRE(rc == MULTIRAIL_ERR_BUFFER_TOO_SMALL && needed >= 3,
                "notifications size query returned %d, needed %zu", (int)rc, needed);
        if (needed > 3) { /* more than "[]" */
            char *json = malloc(needed + 256);
            REQUIRE(json != NULL, "out of memory");
            CHECK(multirail_notifications(e, json, needed + 256, &needed));
            const char *at = json;
            for (;;) {
                char f[256], m[256];
                at = json_field(at, "from", f, sizeof f);
                if (at == NULL) break;
                at = json_field(at, "msg", m, sizeof m);
                if (at == NULL) break;
                if (strncmp(m, prefix, strlen(prefix)) == 0) {
                    snprintf(msg, msg_cap, "%s", m);
                    snprintf(from, from_cap, "%s", f);
                    free(json);
                    return;
                }
            }
            free(json);
        }
        sleep_ms(5);
    }
    REQUIRE(0, "no notification \"%s...\" within %d ms", prefix, PATIENCE_MS);
}

static int run_target(const char *config, uint64_t len) {
    role = "target";
    multirail_engine_t e = 0;
    CHECK(multirail_engine_new(config, "127.0.0.1:0", &e));
    uint64_t addr = 0;
    CHECK(multirail_allocate(e, (size_t)len, "*", &addr));

    size_t needed = 0;
    REQUIRE(multirail_segment_name(e, NULL, 0, &needed) == MULTIRAIL_ERR_BUFFER_TOO_SMALL,
            "segment name size query did not say BUFFER_TOO_SMALL");
    char *name = malloc(needed);
    REQUIRE(name != NULL, "out of memory");
    CHECK(multirail_segment_name(e, name, needed, &needed));
    printf("SEGMENT %s\nADDR %" PRIu64 "\nLEN %" PRIu64 "\n", name, addr, len);
    fflush(stdout);
    free(name);

    char msg[256], from[256];
    wait_notification(e, "done ", msg, sizeof msg, from, sizeof from);
    unsigned seed = (unsigned)strtoul(msg + 5, NULL, 10);
    /* The engine owns this memory; the notification came after the data, so it is there. */
    uint64_t bad = first_mismatch((const uint8_t *)(uintptr_t)addr, len, seed);
    uint64_t back = 0;
    CHECK(multirail_open_segment(e, from, &back));
    const char *answer = bad == len ? "ok" : "bad";
    CHECK(multirail_send(e, back, answer, strlen(answer)));
    REQUIRE(bad == len, "byte %" PRIu64 " of %" PRIu64 " is %u, expected %u", bad, len,
            ((const uint8_t *)(uintptr_t)addr)[bad], pattern(bad, seed));

    size_t stats_len = 0;
    REQUIRE(multirail_traffic_stats_json(e, NULL, 0, &stats_len) == MULTIRAIL_ERR_BUFFER_TOO_SMALL,
            "traffic stats size query");
    char *stats = malloc(stats_len + 1024);
    REQUIRE(stats != NULL, "out of memory");
    CHECK(multirail_traffic_stats_json(e, stats, stats_len + 1024, &stats_len));
    REQUIRE(stats[0] == '{' && strstr(stats, "\"rails\"") != NULL, "stats: %s", stats);
    free(stats);

    /* Serve until told to stop: stdin closes once the initiator is done. */
    while (getchar() != EOF) {
    }
    CHECK(multirail_close_segment(e, back));
    CHECK(multirail_unregister(e, addr));
    CHECK(multirail_engine_free(e));
    printf("TARGET OK verified %" PRIu64 " bytes\n", len);
    return 0;
}

/* Submits `n` requests into a fresh batch, waits, checks each completed, frees the batch. */
static void transfer(multirail_engine_t e, const multirail_request_t *reqs, size_t n,
                     const char *notification) {
    uint64_t batch = 0;
    CHECK(multirail_batch_allocate(e, n, &batch));
    CHECK(multirail_batch_submit(e, batch, reqs, n, notification));
    CHECK(multirail_batch_wait(e, batch, PATIENCE_MS));
    for (size_t i = 0; i < n; i++) {
        int32_t status = -1;
        CHECK(multirail_batch_status(e, batch, i, &status));
        REQUIRE(status == MULTIRAIL_STATUS_COMPLETED, "request %zu: status %d", i, (int)status);
    }
    int32_t overall = -1;
    CHECK(multirail_batch_overall_status(e, batch, &overall));
    REQUIRE(overall == MULTIRAIL_STATUS_COMPLETED, "batch status %d", (int)overall);
    CHECK(multirail_batch_free(e, batch));
}

static void check_error_paths(multirail_engine_t e, uint64_t seg, uint64_t src, uint64_t addr,
                              uint64_t len, uint64_t list) {
    uint64_t out = 0;
    size_t size = 0;
    int32_t status = 0;
    char small[2];

    /* NULL pointers, each named in the message. */
    EXPECT_ERR(multirail_engine_new(NULL, NULL, NULL), MULTIRAIL_ERR_NULL_POINTER, "out");
    EXPECT_ERR(multirail_allocate(e, 64, NULL, NULL), MULTIRAIL_ERR_NULL_POINTER, "addr_out");
    EXPECT_ERR(multirail_register(e, NULL, 64, NULL), MULTIRAIL_ERR_NULL_POINTER, "ptr");
    EXPECT_ERR(multirail_open_segment(e, NULL, &out), MULTIRAIL_ERR_NULL_POINTER, "name");
    EXPECT_ERR(multirail_open_segment(e, "x:1", NULL), MULTIRAIL_ERR_NULL_POINTER, "segment_out");
    EXPECT_ERR(multirail_engine_name(e, NULL, 0, NULL), MULTIRAIL_ERR_NULL_POINTER, "needed");
    EXPECT_ERR(multirail_engine_name(e, NULL, 8, &size), MULTIRAIL_ERR_NULL_POINTER, "buf");
    EXPECT_ERR(multirail_segment_buffers(e, seg, NULL, 0, NULL), MULTIRAIL_ERR_NULL_POINTER, "count");
    EXPECT_ERR(multirail_batch_allocate(e, 1, NULL), MULTIRAIL_ERR_NULL_POINTER, "batch_out");
    EXPECT_ERR(multirail_batch_submit(e, 1, NULL, 1, NULL), MULTIRAIL_ERR_NULL_POINTER, "requests");
    EXPECT_ERR(multirail_batch_status(e, 1, 0, NULL), MULTIRAIL_ERR_NULL_POINTER, "status_out");
    EXPECT_ERR(multirail_batch_overall_status(e, 1, NULL), MULTIRAIL_ERR_NULL_POINTER, "status_out");
    EXPECT_ERR(multirail_prepare(e, NULL, 1, MULTIRAIL_TRANSPORT_AUTO, &out),
               MULTIRAIL_ERR_NULL_POINTER, "entries");
    EXPECT_ERR(multirail_prepared_submit(e, 1, list, MULTIRAIL_OP_WRITE, MULTIRAIL_PRIO_HIGH, NULL, 2,
                                         NULL),
               MULTIRAIL_ERR_NULL_POINTER, "indices");
    EXPECT_ERR(multirail_prepared_len(e, list, NULL), MULTIRAIL_ERR_NULL_POINTER, "len_out");
    EXPECT_ERR(multirail_notify(e, seg, NULL), MULTIRAIL_ERR_NULL_POINTER, "msg");
    EXPECT_ERR(multirail_notifications(e, NULL, 0, NULL), MULTIRAIL_ERR_NULL_POINTER, "needed");
    EXPECT_ERR(multirail_send(e, seg, NULL, 4), MULTIRAIL_ERR_NULL_POINTER, "data");
    EXPECT_ERR(multirail_recv(e, 0, NULL, 0, NULL, NULL, 0), MULTIRAIL_ERR_NULL_POINTER, "len_out");
    EXPECT_ERR(multirail_traffic_stats_json(e, NULL, 0, NULL), MULTIRAIL_ERR_NULL_POINTER, "needed");

    /* A buffer too small says how big it must be, and copies nothing. */
    small[0] = 'x';
    EXPECT_ERR(multirail_engine_name(e, small, sizeof small, &size), MULTIRAIL_ERR_BUFFER_TOO_SMALL,
               "buf");
    REQUIRE(size > sizeof small && small[0] == 'x', "needed %zu", size);
    multirail_buffer_info_t none[1];
    EXPECT_ERR(multirail_segment_buffers(e, seg, none, 0, &size), MULTIRAIL_ERR_BUFFER_TOO_SMALL,
               "out");
    REQUIRE(size >= 1, "segment buffers count %zu", size);

    /* Unknown handles: engine 0 and one never issued. */
    EXPECT_ERR(multirail_engine_name(0, small, sizeof small, &size), MULTIRAIL_ERR_UNKNOWN_HANDLE,
               "0");
    EXPECT_ERR(multirail_batch_allocate(987654321, 1, &out), MULTIRAIL_ERR_UNKNOWN_HANDLE,
               "987654321");

    /* A freed batch. */
    uint64_t batch = 0;
    CHECK(multirail_batch_allocate(e, 2, &batch));
    CHECK(multirail_batch_free(e, batch));
    EXPECT_ERR(multirail_batch_status(e, batch, 0, &status), MULTIRAIL_ERR_UNKNOWN_HANDLE, "batch");
    EXPECT_ERR(multirail_batch_wait(e, batch, 0), MULTIRAIL_ERR_UNKNOWN_HANDLE, "batch");
    EXPECT_ERR(multirail_batch_free(e, batch), MULTIRAIL_ERR_UNKNOWN_HANDLE, "batch");
    multirail_request_t ok = {MULTIRAIL_OP_WRITE, src, seg, addr, 64, MULTIRAIL_PRIO_HIGH};
    EXPECT_ERR(multirail_batch_submit(e, batch, &ok, 1, NULL), MULTIRAIL_ERR_UNKNOWN_HANDLE, "batch");

    /* Out-of-range requests and bad values, refused before anything starts. */
    CHECK(multirail_batch_allocate(e, 1, &batch));
    multirail_request_t r = ok;
    r.target_offset = addr + len - 8; /* 64 bytes from 8 before the end */
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_OUT_OF_RANGE, "outside");
    r = ok;
    r.source = (uint64_t)(uintptr_t)&status; /* not registered */
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_OUT_OF_RANGE,
               "registered");
    r = ok;
    r.opcode = 7;
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_INVALID_ARGUMENT,
               "requests[0].opcode");
    r = ok;
    r.priority = 3;
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_INVALID_ARGUMENT,
               "requests[0].priority");
    r = ok;
    r.length = 0;
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_INVALID_ARGUMENT,
               "requests[0].length");
    EXPECT_ERR(multirail_batch_submit(e, batch, &ok, 0, NULL), MULTIRAIL_ERR_INVALID_ARGUMENT, "n");
    multirail_request_t two[2] = {ok, ok};
    EXPECT_ERR(multirail_batch_submit(e, batch, two, 2, NULL), MULTIRAIL_ERR_BATCH, "batch");
    EXPECT_ERR(multirail_batch_status(e, batch, 0, &status), MULTIRAIL_ERR_INVALID_ARGUMENT, "index");
    CHECK(multirail_batch_free(e, batch));
    EXPECT_ERR(multirail_allocate(e, 0, NULL, &out), MULTIRAIL_ERR_INVALID_ARGUMENT, "len");
    EXPECT_ERR(multirail_allocate(e, 64, "gpu:0", &out), MULTIRAIL_ERR_INVALID_ARGUMENT, "location");
    EXPECT_ERR(multirail_unregister(e, 12345), MULTIRAIL_ERR_INVALID_ARGUMENT, "addr");
    EXPECT_ERR(multirail_engine_new("{\"no_such_key\": 1}", NULL, &out), MULTIRAIL_ERR_CONFIG,
               "no_such_key");
    EXPECT_ERR(multirail_engine_new("{}", "not an address", &out), MULTIRAIL_ERR_INVALID_ARGUMENT,
               "listen");

    /* Prepared lists: an index past the end, an unknown transport, a freed list. */
    CHECK(multirail_batch_allocate(e, 4, &batch));
    size_t past = CHUNKS;
    EXPECT_ERR(multirail_prepared_submit(e, batch, list, MULTIRAIL_OP_READ, MULTIRAIL_PRIO_LOW, &past,
                                         1, NULL),
               MULTIRAIL_ERR_INVALID_ARGUMENT, "indices");
    EXPECT_ERR(multirail_prepared_submit(e, batch, list, 5, MULTIRAIL_PRIO_LOW, NULL, 0, NULL),
               MULTIRAIL_ERR_INVALID_ARGUMENT, "opcode");
    multirail_prepared_entry_t entry = {src, seg, addr, 64};
    EXPECT_ERR(multirail_prepare(e, &entry, 1, 9, &out), MULTIRAIL_ERR_INVALID_ARGUMENT, "transport");
    uint64_t scratch = 0;
    CHECK(multirail_prepare(e, &entry, 1, MULTIRAIL_TRANSPORT_AUTO, &scratch));
    CHECK(multirail_prepared_free(e, scratch));
    EXPECT_ERR(multirail_prepared_len(e, scratch, &size), MULTIRAIL_ERR_UNKNOWN_HANDLE, "list");
    EXPECT_ERR(multirail_prepared_submit(e, batch, scratch, MULTIRAIL_OP_READ, MULTIRAIL_PRIO_LOW,
                                         NULL, 0, NULL),
               MULTIRAIL_ERR_UNKNOWN_HANDLE, "list");
    EXPECT_ERR(multirail_prepared_free(e, scratch), MULTIRAIL_ERR_UNKNOWN_HANDLE, "list");
    CHECK(multirail_batch_free(e, batch));

    /* Unknown segments: an id never issued, and a name nothing answers at. */
    CHECK(multirail_batch_allocate(e, 1, &batch));
    r = ok;
    r.segment = 424242;
    EXPECT_ERR(multirail_batch_submit(e, batch, &r, 1, NULL), MULTIRAIL_ERR_UNKNOWN_HANDLE, "424242");
    CHECK(multirail_batch_free(e, batch));
    EXPECT_ERR(multirail_segment_buffers(e, 424242, none, 1, &size), MULTIRAIL_ERR_UNKNOWN_HANDLE,
               "424242");
    EXPECT_ERR(multirail_notify(e, 424242, "hello"), MULTIRAIL_ERR_UNKNOWN_HANDLE, "424242");
    EXPECT_ERR(multirail_close_segment(e, 424242), MULTIRAIL_ERR_UNKNOWN_HANDLE, "424242");
    EXPECT_ERR(multirail_open_segment(e, "127.0.0.1:1", &out), MULTIRAIL_ERR_PEER, "127.0.0.1:1");
    EXPECT_ERR(multirail_open_segment(e, "no port", &out), MULTIRAIL_ERR_PEER, "no port");

    /* Nothing to receive yet. */
    EXPECT_ERR(multirail_recv(e, 0, NULL, 0, &size, NULL, 0), MULTIRAIL_ERR_WAIT_TIMEOUT, "ms");

    /* A success clears the last error. */
    CHECK(multirail_prepared_len(e, list, &size));
    REQUIRE(multirail_last_error()[0] == '\0', "last error after a success: %s",
            multirail_last_error());
}

static int run_initiator(const char *segment, uint64_t addr, uint64_t len, const char *config,
                         unsigned rounds) {
    role = "initiator";
    REQUIRE(len >= CHUNKS * 64 && len % CHUNKS == 0, "LEN must be a multiple of %d, at least %d",
            CHUNKS, CHUNKS * 64);
    multirail_engine_t e = 0;
    CHECK(multirail_engine_new(config, "127.0.0.1:0", &e));
    uint64_t seg = 0;
    CHECK(multirail_open_segment(e, segment, &seg));
    /* The target skips notifications it does not wait for. */
    CHECK(multirail_notify(e, seg, "hello"));

    /* The target's buffer is among those its segment lists. */
    size_t count = 0;
    int32_t rc = multirail_segment_buffers(e, seg, NULL, 0, &count);
    REQUIRE(rc == MULTIRAIL_ERR_BUFFER_TOO_SMALL && count >= 1, "segment buffers: %d, %zu", (int)rc,
            count);
    multirail_buffer_info_t *buffers = calloc(count, sizeof *buffers);
    REQUIRE(buffers != NULL, "out of memory");
    CHECK(multirail_segment_buffers(e, seg, buffers, count, &count));
    int found = 0;
    for (size_t i = 0; i < count; i++) found |= buffers[i].addr == addr && buffers[i].len == len;
    free(buffers);
    REQUIRE(found, "segment %s does not list buffer %" PRIu64 "+%" PRIu64, segment, addr, len);

    /* Source: memory the engine allocates. Destination of reads: the caller's own memory. */
    uint64_t src = 0;
    CHECK(multirail_allocate(e, (size_t)len, NULL, &src));
    uint8_t *src_p = (uint8_t *)(uintptr_t)src;
    uint8_t *dst_p = malloc((size_t)len);
    REQUIRE(dst_p != NULL, "out of memory");
    memset(dst_p, 0, (size_t)len);
    CHECK(multirail_register(e, dst_p, (size_t)len, "*"));
    uint64_t dst = (uint64_t)(uintptr_t)dst_p;
    uint64_t verified = 0;

    /* Write a pattern, read it back, check every byte. */
    fill_pattern(src_p, len, 1);
    multirail_request_t w = {MULTIRAIL_OP_WRITE, src, seg, addr, len, MULTIRAIL_PRIO_HIGH};
    transfer(e, &w, 1, NULL);
    /* Two reads at different priorities, one per half. */
    multirail_request_t rd[2] = {
        {MULTIRAIL_OP_READ, dst, seg, addr, len / 2, MULTIRAIL_PRIO_MEDIUM},
        {MULTIRAIL_OP_READ, dst + len / 2, seg, addr + len / 2, len - len / 2, MULTIRAIL_PRIO_LOW},
    };
    transfer(e, rd, 2, NULL);
    uint64_t bad = first_mismatch(dst_p, len, 1);
    REQUIRE(bad == len, "read back: byte %" PRIu64 " is %u, expected %u", bad, dst_p[bad],
            pattern(bad, 1));
    verified += len;

    /* A prepared list of CHUNKS entries, posted `rounds` times each way. */
    multirail_prepared_entry_t entries[CHUNKS];
    uint64_t chunk = len / CHUNKS;
    for (size_t i = 0; i < CHUNKS; i++) {
        entries[i].source = src + i * chunk;
        entries[i].segment = seg;
        entries[i].target_offset = addr + i * chunk;
        entries[i].length = chunk;
    }
    uint64_t list = 0;
    CHECK(multirail_prepare(e, entries, CHUNKS, MULTIRAIL_TRANSPORT_AUTO, &list));
    size_t list_len = 0;
    CHECK(multirail_prepared_len(e, list, &list_len));
    REQUIRE(list_len == CHUNKS, "prepared_len %zu", list_len);
    for (unsigned round = 0; round < rounds; round++) {
        unsigned seed = 2 + round;
        fill_pattern(src_p, len, seed);
        uint64_t batch = 0;
        CHECK(multirail_batch_allocate(e, 2 * CHUNKS, &batch));
        CHECK(multirail_prepared_submit(e, batch, list, MULTIRAIL_OP_WRITE, MULTIRAIL_PRIO_HIGH, NULL,
                                        0, NULL));
        CHECK(multirail_batch_wait(e, batch, PATIENCE_MS));
        /* Read back into the source itself, last chunk first, after wiping it. */
        memset(src_p, 0, (size_t)len);
        size_t reversed[CHUNKS];
        for (size_t i = 0; i < CHUNKS; i++) reversed[i] = CHUNKS - 1 - i;
        CHECK(multirail_prepared_submit(e, batch, list, MULTIRAIL_OP_READ, MULTIRAIL_PRIO_LOW,
                                        reversed, CHUNKS, NULL));
        CHECK(multirail_batch_wait(e, batch, PATIENCE_MS));
        int32_t overall = -1;
        CHECK(multirail_batch_overall_status(e, batch, &overall));
        REQUIRE(overall == MULTIRAIL_STATUS_COMPLETED, "round %u: status %d", round, (int)overall);
        CHECK(multirail_batch_free(e, batch));
        bad = first_mismatch(src_p, len, seed);
        REQUIRE(bad == len, "round %u: byte %" PRIu64 " is %u, expected %u", round, bad, src_p[bad],
                pattern(bad, seed));
        verified += len;
    }

    check_error_paths(e, seg, src, addr, len, list);
    CHECK(multirail_prepared_free(e, list));

    /* The final pattern, announced by a notification that arrives after the data. */
    fill_pattern(src_p, len, SEED);
    char done[32];
    snprintf(done, sizeof done, "done %d", SEED);
    transfer(e, &w, 1, done);

    /* The target checked every byte and answers "ok". */
    char answer[16];
    char from[256];
    size_t n = 0;
    rc = multirail_recv(e, PATIENCE_MS, answer, 1, &n, from, sizeof from);
    REQUIRE(rc == MULTIRAIL_ERR_BUFFER_TOO_SMALL && n == 2, "recv into 1 byte: %d, %zu: %s", (int)rc,
            n, multirail_last_error());
    CHECK(multirail_recv(e, PATIENCE_MS, answer, sizeof answer - 1, &n, from, sizeof from));
    answer[n] = '\0';
    REQUIRE(strcmp(answer, "ok") == 0, "the target answered \"%s\"", answer);

    CHECK(multirail_unregister(e, dst));
    CHECK(multirail_unregister(e, src));
    CHECK(multirail_close_segment(e, seg));
    CHECK(multirail_engine_free(e));
    free(dst_p);

    /* A freed engine handle. */
    size_t size = 0;
    EXPECT_ERR(multirail_engine_free(e), MULTIRAIL_ERR_UNKNOWN_HANDLE, "freed");
    EXPECT_ERR(multirail_engine_name(e, NULL, 0, &size), MULTIRAIL_ERR_UNKNOWN_HANDLE, "freed");
    EXPECT_ERR(multirail_open_segment(e, segment, &seg), MULTIRAIL_ERR_UNKNOWN_HANDLE, "freed");

    printf("INITIATOR OK verified %" PRIu64 " bytes, %d error paths\n", verified + len,
           error_paths_checked);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "target") == 0) {
        uint64_t len = argc >= 4 ? strtoull(argv[3], NULL, 0) : (1u << 20);
        return run_target(config_arg(argc >= 3 ? argv[2] : NULL), len);
    }
    if (argc >= 5 && strcmp(argv[1], "initiator") == 0) {
        unsigned rounds = argc >= 7 ? (unsigned)strtoul(argv[6], NULL, 0) : 3;
        return run_initiator(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0),
                             config_arg(argc >= 6 ? argv[5] : NULL), rounds);
    }
    fprintf(stderr,
            "usage: %s target [CONFIG_JSON|-] [LEN]\n"
            "       %s initiator SEGMENT ADDR LEN [CONFIG_JSON|-] [ROUNDS]\n",
            argv[0], argv[0]);
    return 2;
}
