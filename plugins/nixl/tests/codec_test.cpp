// Checks of codec.h: base64 both ways on every byte value, the notification framing, and the
// reader of multirail_notifications()'s JSON on well-formed and malformed input.
#include <cstdio>
#include <random>
#include <string>

#include "codec.h"

using namespace mrnixl;

static int failures = 0;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                            \
            ++failures;                                                                            \
        }                                                                                          \
    } while (0)

int main() {
    // RFC 4648 test vectors.
    const char *vec[][2] = {{"", ""}, {"f", "Zg=="}, {"fo", "Zm8="}, {"foo", "Zm9v"},
                            {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="}, {"foobar", "Zm9vYmFy"}};
    for (auto &v : vec) {
        CHECK(base64Encode(v[0]) == v[1]);
        CHECK(base64Decode(v[1]) == std::string(v[0]));
    }
    // Every length up to 300 of random bytes, NUL and 0xff included, round-trips.
    std::mt19937 rng(7);
    for (size_t n = 0; n < 300; ++n) {
        std::string s(n, '\0');
        for (auto &c : s) c = char(rng() & 0xff);
        CHECK(base64Decode(base64Encode(s)) == s);
    }
    for (const char *bad : {"Zg=", "Zg=a", "Z===", "Zm9v!A==", "=Zg=", "Zg==Zg=="})
        CHECK(!base64Decode(bad));

    // Framing: agent names and messages of any bytes, ':' and the prefix itself included.
    const std::string msg("a:b\0\xff" "nixl1:x", 11);
    auto d = decodeNotif(encodeNotif("agent:1", msg));
    CHECK(d && d->first == "agent:1" && d->second == msg);
    d = decodeNotif(encodeNotif("", ""));
    CHECK(d && d->first.empty() && d->second.empty());
    // The framed text is ASCII whatever the message, so it is valid UTF-8 for multirail.
    CHECK(encodeNotif("\xc3", msg).find_first_not_of(
              "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=:") ==
          std::string::npos);
    CHECK(!decodeNotif("hello"));
    CHECK(!decodeNotif("nixl1:"));
    CHECK(!decodeNotif("nixl1:YQ==:!!"));

    // JSON list.
    auto l = NotifJsonReader("[]").parse();
    CHECK(l && l->empty());
    l = NotifJsonReader(R"( [ {"from":"h:1","msg":"x"} , {"msg":"a\"b\\c\n\u00e9\ud83d\ude00","extra":[1,{"k":null}],"from":"h:2"} ] )").parse();
    CHECK(l && l->size() == 2);
    if (l && l->size() == 2) {
        CHECK((*l)[0].from == "h:1" && (*l)[0].msg == "x");
        CHECK((*l)[1].from == "h:2");
        CHECK((*l)[1].msg == "a\"b\\c\n\xc3\xa9\xf0\x9f\x98\x80");
    }
    for (const char *bad : {"", "[", "[{]", R"([{"from":1}])", R"([{"msg":"x"}] x)",
                            R"([{"msg":"\ud800"}])", R"([{"msg":"\q"}])", "[{\"msg\":\"a\nb\"}]",
                            R"([{"msg":"x",}])", "{}"})
        CHECK(!NotifJsonReader(bad).parse());

    if (failures) return 1;
    std::puts("codec: all checks passed");
    return 0;
}
