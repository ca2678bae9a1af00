// The part of NIXL 1.5.1's backend plugin interface this plugin touches, declared here so the
// plugin builds without NIXL's source tree or headers.
//
// libnixl and this plugin share C++ objects across the .so boundary: libnixl calls the engine
// through its vtable, reads fields of the engine base class with code inlined into libnixl,
// and hands us descriptor lists whose fields our code reads inline. So what is declared here
// is a binary contract, not a convenience:
//   - the virtual methods of nixlBackendEngine, in vtable order, with their exact parameter
//     types (the order is the only thing libnixl sees; the types keep our overrides honest);
//   - the data members of nixlBackendEngine, nixlBackendInitParams, nixlBackendOptionalArgs,
//     nixlBasicDesc, nixlBlobDesc, nixlMetaDesc and nixlDescList, in declaration order;
//   - nixlBackendPlugin, the struct nixl_plugin_init returns, and its api_version.
// They were checked against the nixl-cu12 1.5.1 wheel: the vtable of its UCX engine
// (readelf relocations of libplugin_UCX.so), the offset libnixl reads initErr at, the offsets
// nixlAgent::createBackend stores nixlBackendInitParams fields at, and the api_version
// libnixl's loader compares with. plugins/nixl/tests/test_abi.py compares the vtables again
// on every run, and the static_asserts at the end pin the offsets.
//
// Names are NIXL's own so that the mangled signatures of our overrides can be compared with
// the wheel's symbols; the plugin exports nothing but nixl_plugin_init and nixl_plugin_fini,
// so these classes never collide with libnixl's at run time.

#ifndef MULTIRAIL_NIXL_ABI_H
#define MULTIRAIL_NIXL_ABI_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- plain types (nixl_types.h) ----

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };

enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

enum class nixl_thread_sync_t { NONE, STRICT, RW };

enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void *;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;

class nixlBackendH;

// Only passed by pointer to estimateXferCost, which we do not implement; its name is part of
// that method's signature, its layout is never read here.
struct nixlAgentOptionalArgs;

// ---- descriptors (nixl_descriptors.h, backend_aux.h) ----

// Not polymorphic: three words.
class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

// A registration descriptor: the basic part, then an opaque blob (for remote descriptors, the
// owner's getPublicData output).
class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

class nixlBackendMD;

// A transfer descriptor: the basic part, then the backend's metadata object for the
// registration the range lies in (what registerMem / loadRemoteMD / loadLocalMD returned).
class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

class nixlRemoteMetaDesc : public nixlMetaDesc {
public:
    std::string remoteAgent;
};

// NIXL's descriptor list is polymorphic (a virtual destructor and virtual resize, addDesc and
// getIndex), so it starts with a vtable pointer, then the memory type, then the vector. We only
// read lists libnixl built and never construct, copy or destroy one, so the vtable pointer is
// declared as an opaque word instead of re-declaring virtual members we would never define.
template <class T> class nixlDescList {
    const void *vptr_;

protected:
    nixl_mem_t type;
    std::vector<T> descs;

public:
    nixlDescList() = delete;
    nixlDescList(const nixlDescList &) = delete;
    nixlDescList &operator=(const nixlDescList &) = delete;

    nixl_mem_t getType() const { return type; }
    int descCount() const { return static_cast<int>(descs.size()); }
    const T &operator[](size_t i) const { return descs[i]; }
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

// ---- backend support objects (backend_aux.h) ----

// What postXfer / prepXfer get besides the lists.
struct nixlBackendOptionalArgs {
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

// Built by nixlAgent::createBackend on its stack and passed to create_engine.
class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0; // microseconds
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

// Base of every transfer handle a backend gives out; libnixl only stores the pointer and hands
// it back (releaseReqH frees it).
class nixlBackendReqH {
public:
    nixlBackendReqH() = default;
    virtual ~nixlBackendReqH() = default;
};

// Base of every metadata object a backend gives out (registrations and loaded remote
// metadata); libnixl stores the pointer in descriptors and hands it back.
class nixlBackendMD {
protected:
    bool isPrivateMD;

public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~nixlBackendMD() = default;
};

// ---- telemetry (only so the engine base has the right size and member offsets) ----

enum class nixl_telemetry_event_type_t : uint32_t {};

struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType_;
    uint64_t value_;
};

// ---- the engine (backend_engine.h) ----

class nixlBackendEngine {
private:
    // libnixl reads these through inline accessors (getType, getCustomParams) and moves the
    // telemetry vector out under its mutex (getTelemetryEvents); none of that is our code.
    nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    // libnixl checks initErr right after create_engine and drops the engine when it is set.
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *p)
        : backendType(p->type),
          customParams(p->customParams ? *p->customParams : nixl_b_params_t{}),
          localAgent(p->localAgent),
          enableTelemetry_(p->enableTelemetry_) {}

    nixlBackendEngine(const nixlBackendEngine &) = delete;
    nixlBackendEngine &operator=(const nixlBackendEngine &) = delete;

    const nixl_b_params_t &getCustomParams() const noexcept { return customParams; }

    // Vtable slots, in order. Slots 0 and 1 are the complete and deleting destructors.
    virtual ~nixlBackendEngine() = default;
    /* 2 */ virtual bool supportsRemote() const = 0;
    /* 3 */ virtual bool supportsLocal() const = 0;
    /* 4 */ virtual bool supportsNotif() const = 0;
    /* 5 */ virtual nixl_mem_list_t getSupportedMems() const = 0;
    /* 6 */ virtual nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    /* 7 */ virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    /* 8 */ virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    /* 9 */ virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    /* 10 */ virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    /* 11 */ virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation,
                                            const nixl_meta_dlist_t &local,
                                            const nixl_meta_dlist_t &remote,
                                            const std::string &remote_agent,
                                            nixlBackendReqH *&handle,
                                            const nixl_opt_b_args_t *opt_args) const = 0;
    /* 12 */ virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation,
                                            const nixl_meta_dlist_t &local,
                                            const nixl_meta_dlist_t &remote,
                                            const std::string &remote_agent,
                                            nixlBackendReqH *&handle,
                                            const nixl_opt_b_args_t *opt_args) const = 0;
    /* 13 */ virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    /* 14 */ virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;
    /* 15 */ virtual nixl_status_t
    prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 16 */ virtual nixl_status_t
    prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 17 */ virtual void releaseMemView(nixlMemViewH) const {}
    /* 18 */ virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    /* 19 */ virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    /* 20 */ virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    /* 21 */ virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &,
                                                const nixl_mem_t &,
                                                const std::string &,
                                                nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    /* 22 */ virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    /* 23 */ virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    /* 24 */ virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    /* 25 */ virtual nixl_status_t queryMem(const nixl_reg_dlist_t &,
                                            std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 26 */ virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &,
                                                    const nixl_meta_dlist_t &,
                                                    const nixl_meta_dlist_t &,
                                                    const std::string &,
                                                    nixlBackendReqH *const &,
                                                    std::chrono::microseconds &,
                                                    std::chrono::microseconds &,
                                                    nixl_cost_t &,
                                                    const nixlAgentOptionalArgs *) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

// ---- the plugin entry point (backend_plugin.h) ----

// libnixl's loader refuses a plugin whose api_version differs; 1.5.1 compares with 1.
inline constexpr int NIXL_PLUGIN_API_VERSION = 1;

struct nixlBackendPlugin {
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

// ---- offsets seen in the 1.5.1 wheel's machine code ----

// offsetof on these non-standard-layout classes is what GCC and Clang compute for the Itanium
// ABI, which is the very layout in question.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
// nixlAgent::createBackend tests `cmpb $0, 0xa0(engine)` after create_engine.
static_assert(sizeof(std::string) == 32 && sizeof(nixl_b_params_t) == 56 &&
                  sizeof(std::mutex) == 40,
              "libstdc++ with the C++11 string ABI on x86-64 is assumed");
struct nixlAbiProbe : nixlBackendEngine {
    static constexpr size_t initErrOffset() { return offsetof(nixlAbiProbe, initErr); }
    static constexpr size_t localAgentOffset() { return offsetof(nixlAbiProbe, localAgent); }
};
static_assert(nixlAbiProbe::initErrOffset() == 0xa0);
static_assert(nixlAbiProbe::localAgentOffset() == 0xa8);
static_assert(sizeof(nixlBackendEngine) == 0xd0);
// createBackend stores customParams at +0x40, enableProgTh +0x48, pthrDelay +0x50, syncMode
// +0x58 and enableTelemetry_ +0x5c of the init params it passes.
static_assert(offsetof(nixlBackendInitParams, customParams) == 0x40);
static_assert(offsetof(nixlBackendInitParams, enableProgTh) == 0x48);
static_assert(offsetof(nixlBackendInitParams, pthrDelay) == 0x50);
static_assert(offsetof(nixlBackendInitParams, syncMode) == 0x58);
static_assert(offsetof(nixlBackendInitParams, enableTelemetry_) == 0x5c);
static_assert(sizeof(nixlBasicDesc) == 24 && sizeof(nixlMetaDesc) == 32);
static_assert(offsetof(nixlBlobDesc, metaInfo) == 24);
static_assert(offsetof(nixlBackendOptionalArgs, hasNotif) == 32);
static_assert(offsetof(nixlBackendPlugin, get_backend_mems) == 48);
#pragma GCC diagnostic pop

#endif
