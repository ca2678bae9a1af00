// NIXL backend plugin MULTIRAIL: NIXL's backend engine interface on multirail's C API.
//
// What maps to what (docs/nixl.md has the user's view):
//   agent connection info      -> this engine's multirail segment name (host:port)
//   registerMem / deregister   -> multirail_register / multirail_unregister
//   public data of a region    -> "multirail1 <segment name> <address>"
//   loadRemoteConnInfo/MD      -> the peer's segment name, opened on first use
//   prepXfer                   -> multirail_prepare: local descriptor i paired with remote i
//   postXfer                   -> a fresh batch, multirail_prepared_submit (all entries), with
//                                 the notification multirail sends once the data is in place
//   checkXfer                  -> the batch's overall status (FAILED is an error)
//   releaseReqH                -> waits out a batch still running, frees batch and list
//   genNotif / getNotifs       -> multirail_notify / multirail_notifications, framed so the
//                                 sending agent's name and arbitrary bytes survive
//   disconnect                 -> multirail_close_segment (closes the peer's connections)

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "codec.h"
#include "multirail.h"
#include "nixl_abi.h"

#ifndef MULTIRAIL_NIXL_VERSION
#define MULTIRAIL_NIXL_VERSION "0.0.0"
#endif

namespace {

using mrnixl::decodeNotif;
using mrnixl::encodeNotif;

// ---- logging ----
// libnixl logs through an absl logger we cannot reach from here, so the plugin writes its own
// lines to stderr: errors always, and everything with MULTIRAIL_NIXL_LOG=debug.

bool debugEnabled() {
    static const bool on = [] {
        const char *v = std::getenv("MULTIRAIL_NIXL_LOG");
        return v && std::strcmp(v, "debug") == 0;
    }();
    return on;
}

void logLine(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void logLine(const char *level, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "[nixl MULTIRAIL %s] %s\n", level, buf);
}

#define MR_ERROR(...) logLine("error", __VA_ARGS__)
#define MR_WARN(...) logLine("warn", __VA_ARGS__)
#define MR_DEBUG(...)                                                                              \
    do {                                                                                           \
        if (debugEnabled()) logLine("debug", __VA_ARGS__);                                         \
    } while (0)

const char *lastError() {
    const char *e = multirail_last_error();
    return e ? e : "";
}

// A multirail failure as NIXL sees it. A peer that is gone is NIXL_ERR_REMOTE_DISCONNECT:
// libnixl then drops that agent's metadata (and calls disconnect), as it does for UCX, and the
// application must load the agent again once it is back.
nixl_status_t toNixl(int32_t rc) {
    switch (rc) {
    case MULTIRAIL_OK: return NIXL_SUCCESS;
    case MULTIRAIL_ERR_INVALID_ARGUMENT:
    case MULTIRAIL_ERR_NULL_POINTER:
    case MULTIRAIL_ERR_OUT_OF_RANGE: return NIXL_ERR_INVALID_PARAM;
    case MULTIRAIL_ERR_UNKNOWN_HANDLE: return NIXL_ERR_NOT_FOUND;
    case MULTIRAIL_ERR_PEER:
    case MULTIRAIL_ERR_TIMEOUT: return NIXL_ERR_REMOTE_DISCONNECT;
    case MULTIRAIL_ERR_NOT_A_MEMBER: return NIXL_ERR_NOT_ALLOWED;
    default: return NIXL_ERR_BACKEND;
    }
}

// Called in a catch block: an exception (std::bad_alloc, in practice) must not unwind into
// libnixl, which expects a status from a backend, so it is logged and becomes a backend error.
nixl_status_t caught(const char *where) {
    try {
        throw;
    } catch (const std::exception &e) {
        MR_ERROR("%s: %s", where, e.what());
    } catch (...) {
        MR_ERROR("%s: an exception that is not a std::exception", where);
    }
    return NIXL_ERR_BACKEND;
}

// Reads one of the C API's string outputs, growing the buffer when it says so.
template <class F> int32_t readString(std::string &out, F &&call) {
    size_t cap = out.capacity() > 256 ? out.capacity() : 256;
    for (int tries = 0; tries < 8; ++tries) {
        out.resize(cap);
        size_t needed = 0;
        const int32_t rc = call(out.data(), cap, &needed);
        if (rc == MULTIRAIL_OK) {
            out.resize(needed > 0 ? needed - 1 : std::strlen(out.c_str()));
            return rc;
        }
        if (rc != MULTIRAIL_ERR_BUFFER_TOO_SMALL || needed <= cap) {
            out.clear();
            return rc;
        }
        cap = needed;
    }
    out.clear();
    return MULTIRAIL_ERR_INTERNAL;
}

// ---- backend options ----

struct Options {
    std::string config; // JSON text, or a path to a JSON file; "" = MULTIRAIL_CONF or defaults
    std::string listen; // "ADDR:PORT"; "" = 0.0.0.0:0
    int32_t transport = MULTIRAIL_TRANSPORT_AUTO;
    int32_t priority = MULTIRAIL_PRIO_HIGH;
};

const nixl_b_params_t &defaultOptions() {
    static const nixl_b_params_t opts = {
        {"config", ""},
        {"transport", "auto"},
        {"listen", ""},
        {"priority", "high"},
    };
    return opts;
}

bool parseTransport(const std::string &v, int32_t &out) {
    if (v.empty() || v == "auto") out = MULTIRAIL_TRANSPORT_AUTO;
    else if (v == "tcp") out = MULTIRAIL_TRANSPORT_TCP;
    else if (v == "shm") out = MULTIRAIL_TRANSPORT_SHM;
    else if (v == "rdma") out = MULTIRAIL_TRANSPORT_RDMA;
    else return false;
    return true;
}

bool parsePriority(const std::string &v, int32_t &out) {
    if (v.empty() || v == "high") out = MULTIRAIL_PRIO_HIGH;
    else if (v == "medium") out = MULTIRAIL_PRIO_MEDIUM;
    else if (v == "low") out = MULTIRAIL_PRIO_LOW;
    else return false;
    return true;
}

// The "config" option holds JSON text or names a file of it, like MULTIRAIL_CONF.
bool loadConfig(const std::string &v, std::string &json, std::string &err) {
    size_t i = v.find_first_not_of(" \t\r\n");
    if (i == std::string::npos) {
        json.clear();
        return true;
    }
    if (v[i] == '{') {
        json = v;
        return true;
    }
    std::ifstream f(v);
    if (!f) {
        err = "option 'config': not JSON and no readable file at '" + v + "'";
        return false;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    json = ss.str();
    return true;
}

// ---- metadata objects handed to libnixl ----

// A local registration.
struct LocalMD final : nixlBackendMD {
    uint64_t addr;
    uint64_t len;
    LocalMD(uint64_t a, uint64_t l) : nixlBackendMD(true), addr(a), len(l) {}
};

// A region of another agent (or of this one, for local transfers).
struct RemoteMD final : nixlBackendMD {
    std::string agent;
    std::string segment; // the segment name the region lives in
    uint64_t addr;
    uint64_t len;
    RemoteMD(std::string a, std::string s, uint64_t ad, uint64_t l)
        : nixlBackendMD(false), agent(std::move(a)), segment(std::move(s)), addr(ad), len(l) {}
};

constexpr const char *kPublicPrefix = "multirail1 ";

// ---- transfer handle ----

struct XferHandle final : nixlBackendReqH {
    uint64_t list = 0;  // the prepared list, for the handle's life
    uint64_t batch = 0; // the batch of the last post; 0 once it is over and freed
    size_t count = 0;
    int32_t priority = MULTIRAIL_PRIO_HIGH;
    std::string remoteAgent;
    nixl_status_t done = NIXL_ERR_NOT_POSTED; // the outcome of the last post, once known
    // The last post failed while other requests of it still ran: its outcome is known, but the
    // batch is kept until they end, since they still touch the application's memory.
    bool draining = false;
};

// ---- the engine ----

class MultirailEngine final : public nixlBackendEngine {
public:
    explicit MultirailEngine(const nixlBackendInitParams *p) : nixlBackendEngine(p) {
        std::string err;
        if (!init(err)) {
            MR_ERROR("agent '%s': %s", localAgent.c_str(), err.c_str());
            initErr = true;
        }
    }

    ~MultirailEngine() override {
        if (engine_ == 0) return;
        std::lock_guard<std::mutex> g(mu_);
        for (auto &[name, r] : peers_)
            if (r.segment) multirail_close_segment(engine_, r.segment);
        peers_.clear();
        multirail_engine_free(engine_);
        engine_ = 0;
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG}; }

    // ---- memory ----

    nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &type, nixlBackendMD *&out) override try {
        if (type != DRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        if (mem.len == 0) return NIXL_ERR_INVALID_PARAM;
        std::lock_guard<std::mutex> g(mu_);
        // NIXL may register the same region twice (two descriptor lists naming one tensor);
        // multirail refuses overlapping registrations, so identical ones share a count.
        auto it = regs_.find(mem.addr);
        if (it != regs_.end()) {
            if (it->second.len != mem.len) {
                MR_ERROR("registerMem: 0x%" PRIxPTR "+%zu overlaps a registration of %" PRIu64
                         " bytes at the same address",
                         mem.addr, mem.len, it->second.len);
                return NIXL_ERR_INVALID_PARAM;
            }
            ++it->second.refs;
        } else {
            const int32_t rc = multirail_register(
                engine_, reinterpret_cast<void *>(mem.addr), mem.len, nullptr);
            if (rc != MULTIRAIL_OK) {
                MR_ERROR("registerMem 0x%" PRIxPTR "+%zu: %s", mem.addr, mem.len, lastError());
                return toNixl(rc);
            }
            regs_.emplace(mem.addr, Reg{mem.len, 1});
        }
        out = new LocalMD(mem.addr, mem.len);
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("registerMem");
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override try {
        auto *md = dynamic_cast<LocalMD *>(meta);
        if (!md) return NIXL_ERR_INVALID_PARAM;
        nixl_status_t ret = NIXL_SUCCESS;
        {
            std::lock_guard<std::mutex> g(mu_);
            auto it = regs_.find(md->addr);
            if (it != regs_.end() && --it->second.refs == 0) {
                regs_.erase(it);
                const int32_t rc = multirail_unregister(engine_, md->addr);
                if (rc != MULTIRAIL_OK) {
                    MR_ERROR("deregisterMem 0x%" PRIx64 ": %s", md->addr, lastError());
                    ret = toNixl(rc);
                }
            }
        }
        delete md;
        return ret;
    } catch (...) {
        return caught("deregisterMem");
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override try {
        auto *md = dynamic_cast<const LocalMD *>(meta);
        if (!md) return NIXL_ERR_INVALID_PARAM;
        str = kPublicPrefix + segmentName_ + " " + std::to_string(md->addr);
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("getPublicData");
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override try {
        auto *md = dynamic_cast<LocalMD *>(input);
        if (!md) return NIXL_ERR_INVALID_PARAM;
        // A local transfer goes through this engine's own segment, opened like any peer's.
        output = new RemoteMD(localAgent, segmentName_, md->addr, md->len);
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("loadLocalMD");
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input,
                               const nixl_mem_t &type,
                               const std::string &agent,
                               nixlBackendMD *&output) override try {
        if (type != DRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        const std::string &blob = input.metaInfo;
        const size_t plen = std::strlen(kPublicPrefix);
        const size_t space = blob.rfind(' ');
        if (blob.compare(0, plen, kPublicPrefix) != 0 || space == std::string::npos ||
            space < plen) {
            MR_ERROR("loadRemoteMD from '%s': not multirail metadata", agent.c_str());
            return NIXL_ERR_MISMATCH;
        }
        std::string segment = blob.substr(plen, space - plen);
        std::lock_guard<std::mutex> g(mu_);
        auto &peer = peers_[agent];
        if (peer.segmentName.empty()) {
            peer.segmentName = segment;
        } else if (peer.segmentName != segment) {
            MR_ERROR("loadRemoteMD: agent '%s' connects as '%s' but its region lives in '%s'",
                     agent.c_str(), peer.segmentName.c_str(), segment.c_str());
            return NIXL_ERR_MISMATCH;
        }
        output = new RemoteMD(agent, std::move(segment), input.addr, input.len);
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("loadRemoteMD");
    }

    nixl_status_t unloadMD(nixlBackendMD *input) override {
        auto *md = dynamic_cast<RemoteMD *>(input);
        if (!md) return NIXL_ERR_INVALID_PARAM;
        delete md;
        return NIXL_SUCCESS;
    }

    // ---- connections ----

    nixl_status_t getConnInfo(std::string &str) const override try {
        str = segmentName_;
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("getConnInfo");
    }

    nixl_status_t
    loadRemoteConnInfo(const std::string &agent, const std::string &conn_info) override try {
        if (conn_info.empty()) return NIXL_ERR_INVALID_PARAM;
        std::lock_guard<std::mutex> g(mu_);
        auto &peer = peers_[agent];
        if (peer.segmentName != conn_info) {
            // The agent came back under a new address: forget the old segment.
            if (peer.segment) multirail_close_segment(engine_, peer.segment);
            peer.segment = 0;
            peer.segmentName = conn_info;
        }
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("loadRemoteConnInfo");
    }

    nixl_status_t connect(const std::string &agent) override try {
        // libnixl calls connect(own name) when it creates the backend; our own segment is
        // opened on first use instead, so creating a backend never waits on the network.
        if (agent == localAgent) return NIXL_SUCCESS;
        uint64_t seg = 0;
        return segmentOf(agent, seg);
    } catch (...) {
        return caught("connect");
    }

    nixl_status_t disconnect(const std::string &agent) override try {
        std::lock_guard<std::mutex> g(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end()) return NIXL_SUCCESS;
        if (it->second.segment) {
            const int32_t rc = multirail_close_segment(engine_, it->second.segment);
            if (rc != MULTIRAIL_OK && rc != MULTIRAIL_ERR_UNKNOWN_HANDLE)
                MR_WARN("disconnect '%s': %s", agent.c_str(), lastError());
        }
        if (agent == localAgent) {
            it->second.segment = 0; // keep our own name: local transfers may come again
        } else {
            peers_.erase(it);
        }
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("disconnect");
    }

    // ---- transfers ----

    nixl_status_t prepXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote,
                           const std::string &agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt) const override try {
        if (op != NIXL_READ && op != NIXL_WRITE) return NIXL_ERR_INVALID_PARAM;
        if (local.getType() != DRAM_SEG || remote.getType() != DRAM_SEG)
            return NIXL_ERR_NOT_SUPPORTED;
        const int n = local.descCount();
        if (n <= 0 || n != remote.descCount()) return NIXL_ERR_INVALID_PARAM;
        int32_t priority = options_.priority;
        if (opt && !opt->customParam.empty()) {
            // Per-request priority: the customParam of createXferReq / initialize_xfer.
            const std::string &c = opt->customParam;
            const std::string key = "priority=";
            if (c.compare(0, key.size(), key) != 0 || !parsePriority(c.substr(key.size()), priority)) {
                MR_ERROR("prepXfer: customParam '%s' is not priority=high|medium|low", c.c_str());
                return NIXL_ERR_INVALID_PARAM;
            }
        }
        uint64_t segment = 0;
        nixl_status_t st = segmentOf(agent, segment);
        if (st != NIXL_SUCCESS) return st;

        std::vector<multirail_prepared_entry_t> entries(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) {
            const nixlMetaDesc &l = local[i];
            const nixlMetaDesc &r = remote[i];
            if (l.len != r.len || l.len == 0) return NIXL_ERR_INVALID_PARAM;
            entries[i] = multirail_prepared_entry_t{l.addr, segment, r.addr, l.len};
        }
        uint64_t list = 0;
        const int32_t rc =
            multirail_prepare(engine_, entries.data(), entries.size(), options_.transport, &list);
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("prepXfer to '%s' (%d descriptors): %s", agent.c_str(), n, lastError());
            return toNixl(rc);
        }
        auto *h = new XferHandle;
        h->list = list;
        h->count = entries.size();
        h->priority = priority;
        h->remoteAgent = agent;
        handle = h;
        MR_DEBUG("prepXfer to '%s': %d descriptors, list %" PRIu64, agent.c_str(), n, list);
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("prepXfer");
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &,
                           const std::string &agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt) const override try {
        auto *h = dynamic_cast<XferHandle *>(handle);
        if (!h) return NIXL_ERR_INVALID_PARAM;
        if (h->batch != 0) {
            // libnixl asks checkXfer before a repost, so a batch left here either failed with
            // requests still running or is being posted over while it runs.
            if (!h->draining && checkXfer(h) == NIXL_IN_PROG) return NIXL_ERR_REPOST_ACTIVE;
            if (h->batch != 0 && !retire(h, releaseWaitMs_)) return NIXL_ERR_REPOST_ACTIVE;
        }
        uint64_t batch = 0;
        int32_t rc = multirail_batch_allocate(engine_, h->count, &batch);
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("postXfer: batch of %zu: %s", h->count, lastError());
            return toNixl(rc);
        }
        std::string notif;
        if (opt && opt->hasNotif) notif = encodeNotif(localAgent, opt->notifMsg);
        rc = multirail_prepared_submit(engine_,
                                       batch,
                                       h->list,
                                       op == NIXL_READ ? MULTIRAIL_OP_READ : MULTIRAIL_OP_WRITE,
                                       h->priority,
                                       nullptr,
                                       0,
                                       opt && opt->hasNotif ? notif.c_str() : nullptr);
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("postXfer to '%s': %s", agent.c_str(), lastError());
            multirail_batch_free(engine_, batch);
            return toNixl(rc);
        }
        h->batch = batch;
        h->done = NIXL_IN_PROG;
        return NIXL_IN_PROG;
    } catch (...) {
        return caught("postXfer");
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override try {
        auto *h = dynamic_cast<XferHandle *>(handle);
        if (!h) return NIXL_ERR_INVALID_PARAM;
        if (h->batch == 0) return h->done;
        if (h->draining) {
            retire(h, 0);
            return h->done;
        }
        int32_t status = MULTIRAIL_STATUS_PENDING;
        const int32_t rc = multirail_batch_overall_status(engine_, h->batch, &status);
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("checkXfer: %s", lastError());
            return toNixl(rc);
        }
        if (status == MULTIRAIL_STATUS_PENDING) return NIXL_IN_PROG;
        if (status == MULTIRAIL_STATUS_COMPLETED) {
            h->done = NIXL_SUCCESS;
        } else {
            // A request failed (a peer gone or silent past the transport timeout, a bad
            // range): the post is an error now, even if others still run.
            nixl_status_t why = NIXL_ERR_BACKEND;
            const std::string reason = failureReason(h, why);
            MR_ERROR("transfer to '%s' failed: %s", h->remoteAgent.c_str(), reason.c_str());
            h->done = why;
            h->draining = true;
        }
        // A repost takes a new batch; multirail keeps a batch alive for a notification still
        // being sent after it.
        retire(h, 0);
        return h->done;
    } catch (...) {
        return caught("checkXfer");
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override try {
        auto *h = dynamic_cast<XferHandle *>(handle);
        if (!h) return NIXL_ERR_INVALID_PARAM;
        // multirail cannot cancel requests in flight, and the application may free its buffers
        // as soon as this returns, so a running post is waited out. It ends within the
        // transport timeout: completed, or failed once the peer stopped answering.
        if (h->batch != 0 && !retire(h, releaseWaitMs_)) {
            MR_ERROR("releaseReqH: a transfer to '%s' still runs after %" PRId64 " ms",
                     h->remoteAgent.c_str(), releaseWaitMs_);
            return NIXL_ERR_REPOST_ACTIVE;
        }
        if (h->list) multirail_prepared_free(engine_, h->list);
        delete h;
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("releaseReqH");
    }

    // ---- notifications ----

    nixl_status_t getNotifs(notif_list_t &out) override try {
        std::lock_guard<std::mutex> g(notifMu_);
        const int32_t rc = readString(notifBuf_, [&](char *b, size_t cap, size_t *needed) {
            return multirail_notifications(engine_, b, cap, needed);
        });
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("getNotifs: %s", lastError());
            return toNixl(rc);
        }
        auto list = mrnixl::NotifJsonReader(notifBuf_).parse();
        if (!list) {
            MR_ERROR("getNotifs: unreadable notification list");
            return NIXL_ERR_BACKEND;
        }
        for (auto &n : *list) {
            if (auto d = decodeNotif(n.msg)) {
                out.emplace_back(std::move(d->first), std::move(d->second));
            } else {
                // Not from a NIXL agent: a plain multirail notification, keyed by the
                // sender's segment name.
                out.emplace_back(std::move(n.from), std::move(n.msg));
            }
        }
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("getNotifs");
    }

    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override try {
        uint64_t segment = 0;
        nixl_status_t st = segmentOf(agent, segment);
        if (st != NIXL_SUCCESS) return st;
        const std::string text = encodeNotif(localAgent, msg);
        const int32_t rc = multirail_notify(engine_, segment, text.c_str());
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("genNotif to '%s': %s", agent.c_str(), lastError());
            return toNixl(rc);
        }
        return NIXL_SUCCESS;
    } catch (...) {
        return caught("genNotif");
    }

private:
    struct Reg {
        uint64_t len;
        unsigned refs;
    };
    struct Peer {
        std::string segmentName;
        uint64_t segment = 0; // 0 until opened
    };

    bool init(std::string &err) {
        const nixl_b_params_t &params = getCustomParams();
        for (const auto &[k, v] : params)
            if (!defaultOptions().count(k))
                MR_WARN("agent '%s': ignoring unknown option '%s'", localAgent.c_str(), k.c_str());
        auto get = [&](const char *k) {
            auto it = params.find(k);
            return it == params.end() ? std::string() : it->second;
        };
        if (!parseTransport(get("transport"), options_.transport)) {
            err = "option 'transport': '" + get("transport") + "' is not auto, tcp, shm or rdma";
            return false;
        }
        if (!parsePriority(get("priority"), options_.priority)) {
            err = "option 'priority': '" + get("priority") + "' is not high, medium or low";
            return false;
        }
        if (!loadConfig(get("config"), options_.config, err)) return false;
        options_.listen = get("listen");

        const int32_t rc = multirail_engine_new(options_.config.empty() ? nullptr :
                                                                          options_.config.c_str(),
                                                options_.listen.empty() ? nullptr :
                                                                          options_.listen.c_str(),
                                                &engine_);
        if (rc != MULTIRAIL_OK) {
            err = std::string("starting the multirail engine: ") + lastError();
            engine_ = 0;
            return false;
        }
        const int32_t r = readString(segmentName_, [&](char *b, size_t cap, size_t *needed) {
            return multirail_segment_name(engine_, b, cap, needed);
        });
        if (r != MULTIRAIL_OK || segmentName_.empty()) {
            err = std::string("reading the segment name: ") + lastError();
            return false;
        }
        peers_[localAgent].segmentName = segmentName_;
        MR_DEBUG("agent '%s': engine up as segment '%s'", localAgent.c_str(), segmentName_.c_str());
        return true;
    }

    // Frees h's batch once none of its requests runs any more, waiting up to wait_ms (0:
    // just look); false, keeping it, while some still do.
    bool retire(XferHandle *h, int64_t wait_ms) const {
        const int32_t rc = multirail_batch_wait(engine_, h->batch, wait_ms);
        if (rc == MULTIRAIL_ERR_WAIT_TIMEOUT) return false;
        multirail_batch_free(engine_, h->batch);
        h->batch = 0;
        h->draining = false;
        return true;
    }

    // What the first failed request of h's batch says about its failure.
    // The first failed request's reason, and in `status` what it means to NIXL (a peer gone
    // or silent: NIXL_ERR_REMOTE_DISCONNECT; anything else the backend's error).
    std::string failureReason(const XferHandle *h, nixl_status_t &status) const {
        status = NIXL_ERR_BACKEND;
        for (size_t i = 0; i < h->count; ++i) {
            int32_t code = MULTIRAIL_OK;
            if (multirail_batch_request_error(engine_, h->batch, i, &code) != MULTIRAIL_OK) break;
            if (code != MULTIRAIL_OK) {
                const nixl_status_t mapped = toNixl(code);
                if (mapped == NIXL_ERR_REMOTE_DISCONNECT) status = mapped;
                return "request " + std::to_string(i) + " of " + std::to_string(h->count) + ": " +
                    lastError();
            }
        }
        return "(no reason given)";
    }

    // The open segment of `agent`, opening it on first use. The open (a round trip to the
    // peer, up to the connect timeout when it does not answer) runs without the lock, so a
    // slow peer does not hold up registrations or other peers; multirail gives the same id to
    // two opens of one name, so a race between two callers is harmless.
    nixl_status_t segmentOf(const std::string &agent, uint64_t &segment) const {
        std::string name;
        {
            std::lock_guard<std::mutex> g(mu_);
            auto it = peers_.find(agent);
            if (it == peers_.end() || it->second.segmentName.empty()) {
                MR_ERROR("no connection info for agent '%s'", agent.c_str());
                return NIXL_ERR_NOT_FOUND;
            }
            if (it->second.segment != 0) {
                segment = it->second.segment;
                return NIXL_SUCCESS;
            }
            name = it->second.segmentName;
        }
        uint64_t id = 0;
        const int32_t rc = multirail_open_segment(engine_, name.c_str(), &id);
        if (rc != MULTIRAIL_OK) {
            MR_ERROR("opening segment '%s' of agent '%s': %s", name.c_str(), agent.c_str(), lastError());
            return toNixl(rc);
        }
        std::lock_guard<std::mutex> g(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end() || it->second.segmentName != name) {
            // Disconnected or given a new address meanwhile: this open is stale.
            multirail_close_segment(engine_, id);
            MR_ERROR("agent '%s' was disconnected while its segment was being opened", agent.c_str());
            return NIXL_ERR_NOT_FOUND;
        }
        it->second.segment = id;
        segment = id;
        return NIXL_SUCCESS;
    }

    multirail_engine_t engine_ = 0;
    Options options_;
    std::string segmentName_;
    // How long releaseReqH waits for a post still running. Transfers end within the transport
    // timeout on their own; this only bounds a wait that should never be long.
    int64_t releaseWaitMs_ = 60000;

    mutable std::mutex mu_; // peers_ and regs_
    mutable std::map<std::string, Peer> peers_;
    std::map<uint64_t, Reg> regs_;

    std::mutex notifMu_;
    std::string notifBuf_;
};

// ---- the plugin ----

nixlBackendEngine *createEngine(const nixlBackendInitParams *p) {
    try {
        return new MultirailEngine(p);
    } catch (const std::exception &e) {
        MR_ERROR("creating the engine: %s", e.what());
        return nullptr;
    }
}

void destroyEngine(nixlBackendEngine *e) {
    delete e;
}

const char *pluginName() {
    return "MULTIRAIL";
}

const char *pluginVersion() {
    return MULTIRAIL_NIXL_VERSION;
}

nixl_b_params_t backendOptions() {
    return defaultOptions();
}

nixl_mem_list_t backendMems() {
    return {DRAM_SEG};
}

nixlBackendPlugin plugin = {
    NIXL_PLUGIN_API_VERSION,
    createEngine,
    destroyEngine,
    pluginName,
    pluginVersion,
    backendOptions,
    backendMems,
};

} // namespace

extern "C" __attribute__((visibility("default"))) nixlBackendPlugin *nixl_plugin_init() {
    return &plugin;
}

extern "C" __attribute__((visibility("default"))) void nixl_plugin_fini() {}
