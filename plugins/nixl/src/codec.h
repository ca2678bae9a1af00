// Encodings the plugin needs at its two text boundaries:
//   - multirail notifications are UTF-8 text and say which segment sent them, while NIXL
//     notifications are arbitrary bytes keyed by the sending agent's name. A notification
//     therefore travels as "nixl1:" BASE64(agent) ":" BASE64(message).
//   - multirail_notifications() returns a JSON array of {"from": ..., "msg": ...} objects.
// Kept apart from the engine so tests can drive them without NIXL or multirail.

#ifndef MULTIRAIL_NIXL_CODEC_H
#define MULTIRAIL_NIXL_CODEC_H

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mrnixl {

// ---- base64 (RFC 4648, with padding) ----

inline std::string base64Encode(std::string_view in) {
    static constexpr char table[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((in.size() + 2) / 3 * 4);
    size_t i = 0;
    for (; i + 3 <= in.size(); i += 3) {
        const uint32_t v = (uint32_t(uint8_t(in[i])) << 16) | (uint32_t(uint8_t(in[i + 1])) << 8) |
            uint32_t(uint8_t(in[i + 2]));
        out += table[v >> 18];
        out += table[(v >> 12) & 63];
        out += table[(v >> 6) & 63];
        out += table[v & 63];
    }
    const size_t rest = in.size() - i;
    if (rest > 0) {
        uint32_t v = uint32_t(uint8_t(in[i])) << 16;
        if (rest == 2) v |= uint32_t(uint8_t(in[i + 1])) << 8;
        out += table[v >> 18];
        out += table[(v >> 12) & 63];
        out += rest == 2 ? table[(v >> 6) & 63] : '=';
        out += '=';
    }
    return out;
}

// nullopt on any character outside the alphabet, a length that is not a multiple of 4, or
// padding anywhere but the end: a malformed message is reported, never guessed at.
inline std::optional<std::string> base64Decode(std::string_view in) {
    auto value = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+') return 62;
        if (c == '/') return 63;
        return -1;
    };
    if (in.size() % 4 != 0) return std::nullopt;
    std::string out;
    out.reserve(in.size() / 4 * 3);
    for (size_t i = 0; i < in.size(); i += 4) {
        const bool last = i + 4 == in.size();
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; ++k) {
            const char c = in[i + k];
            if (c == '=' && last && k >= 2) {
                v[k] = 0;
                ++pad;
                continue;
            }
            if (pad > 0) return std::nullopt; // data after padding
            v[k] = value(c);
            if (v[k] < 0) return std::nullopt;
        }
        const uint32_t w = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) |
            (uint32_t(v[2]) << 6) | uint32_t(v[3]);
        out += char(w >> 16);
        if (pad < 2) out += char((w >> 8) & 0xff);
        if (pad < 1) out += char(w & 0xff);
    }
    return out;
}

// ---- notification framing ----

inline constexpr std::string_view kNotifPrefix = "nixl1:";

inline std::string encodeNotif(std::string_view agent, std::string_view msg) {
    std::string out(kNotifPrefix);
    out += base64Encode(agent);
    out += ':';
    out += base64Encode(msg);
    return out;
}

// (agent, message) of a framed notification; nullopt for text that is not one (a plain
// multirail notification from a peer that is not this plugin).
inline std::optional<std::pair<std::string, std::string>> decodeNotif(std::string_view text) {
    if (text.substr(0, kNotifPrefix.size()) != kNotifPrefix) return std::nullopt;
    text.remove_prefix(kNotifPrefix.size());
    const size_t colon = text.find(':');
    if (colon == std::string_view::npos) return std::nullopt;
    auto agent = base64Decode(text.substr(0, colon));
    auto msg = base64Decode(text.substr(colon + 1));
    if (!agent || !msg) return std::nullopt;
    return std::make_pair(std::move(*agent), std::move(*msg));
}

// ---- the notification list multirail_notifications() returns ----

struct ReceivedNotif {
    std::string from; // the sender's segment name
    std::string msg;
};

// A strict little JSON reader for one shape: an array of objects whose "from" and "msg" are
// strings (other members of any type are skipped). Returns nullopt on anything malformed.
class NotifJsonReader {
public:
    explicit NotifJsonReader(std::string_view text) : s_(text) {}

    std::optional<std::vector<ReceivedNotif>> parse() {
        std::vector<ReceivedNotif> out;
        ws();
        if (!eat('[')) return std::nullopt;
        ws();
        if (eat(']')) return finish(std::move(out));
        for (;;) {
            ReceivedNotif n;
            if (!object(n)) return std::nullopt;
            out.push_back(std::move(n));
            ws();
            if (eat(']')) return finish(std::move(out));
            if (!eat(',')) return std::nullopt;
            ws();
        }
    }

private:
    std::string_view s_;
    size_t p_ = 0;
    int depth_ = 0;

    std::optional<std::vector<ReceivedNotif>> finish(std::vector<ReceivedNotif> v) {
        ws();
        if (p_ != s_.size()) return std::nullopt;
        return v;
    }

    void ws() {
        while (p_ < s_.size() &&
               (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t'))
            ++p_;
    }
    bool eat(char c) {
        if (p_ < s_.size() && s_[p_] == c) {
            ++p_;
            return true;
        }
        return false;
    }

    bool object(ReceivedNotif &n) {
        if (!eat('{')) return false;
        ws();
        if (eat('}')) return true;
        for (;;) {
            std::string key;
            if (!string(key)) return false;
            ws();
            if (!eat(':')) return false;
            ws();
            if (key == "from" || key == "msg") {
                if (!string(key == "from" ? n.from : n.msg)) return false;
            } else if (!skipValue()) {
                return false;
            }
            ws();
            if (eat('}')) return true;
            if (!eat(',')) return false;
            ws();
        }
    }

    static void putUtf8(std::string &out, uint32_t cp) {
        if (cp < 0x80) {
            out += char(cp);
        } else if (cp < 0x800) {
            out += char(0xc0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            out += char(0xe0 | (cp >> 12));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        } else {
            out += char(0xf0 | (cp >> 18));
            out += char(0x80 | ((cp >> 12) & 0x3f));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        }
    }

    bool hex4(uint32_t &v) {
        if (p_ + 4 > s_.size()) return false;
        v = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = s_[p_++];
            v <<= 4;
            if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
            else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
            else return false;
        }
        return true;
    }

    bool string(std::string &out) {
        out.clear();
        if (!eat('"')) return false;
        while (p_ < s_.size()) {
            const char c = s_[p_++];
            if (c == '"') return true;
            if (static_cast<unsigned char>(c) < 0x20) return false;
            if (c != '\\') {
                out += c;
                continue;
            }
            if (p_ >= s_.size()) return false;
            const char e = s_[p_++];
            switch (e) {
            case '"': out += '"'; break;
            case '\\': out += '\\'; break;
            case '/': out += '/'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'u': {
                uint32_t cp;
                if (!hex4(cp)) return false;
                if (cp >= 0xd800 && cp < 0xdc00) { // a surrogate pair
                    uint32_t lo;
                    if (!eat('\\') || !eat('u') || !hex4(lo) || lo < 0xdc00 || lo >= 0xe000)
                        return false;
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                } else if (cp >= 0xdc00 && cp < 0xe000) {
                    return false;
                }
                putUtf8(out, cp);
                break;
            }
            default: return false;
            }
        }
        return false;
    }

    bool skipValue() {
        if (++depth_ > 64) return false;
        bool ok = false;
        if (p_ < s_.size()) {
            const char c = s_[p_];
            if (c == '"') {
                std::string ignored;
                ok = string(ignored);
            } else if (c == '{' || c == '[') {
                const char close = c == '{' ? '}' : ']';
                ++p_;
                ws();
                ok = eat(close);
                while (!ok) {
                    if (c == '{') {
                        std::string key;
                        ws();
                        if (!string(key)) break;
                        ws();
                        if (!eat(':')) break;
                    }
                    ws();
                    if (!skipValue()) break;
                    ws();
                    if (eat(close)) {
                        ok = true;
                        break;
                    }
                    if (!eat(',')) break;
                }
            } else {
                // number, true, false, null: a run of these characters
                const size_t start = p_;
                while (p_ < s_.size() &&
                       std::string_view("0123456789+-.eEtruefalsn").find(s_[p_]) !=
                           std::string_view::npos)
                    ++p_;
                ok = p_ > start;
            }
        }
        --depth_;
        return ok;
    }
};

} // namespace mrnixl

#endif
