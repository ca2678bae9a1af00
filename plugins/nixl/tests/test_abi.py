"""The plugin's binary contract with libnixl, checked against the installed wheel.

libnixl calls the engine only through its vtable, so a method declared out of order would call
the wrong function with the wrong arguments. This reads both vtables out of the shared objects
(readelf relocations, nm symbols, c++filt) and compares them slot by slot: our engine against
the wheel's UCX engine, which implements every slot of the same base class."""

import pathlib
import re
import shutil
import subprocess

import pytest

import nixl_cu12  # noqa: F401  (the wheel must be importable)

SITE = pathlib.Path(nixl_cu12.__file__).resolve().parents[1]
UCX = SITE / ".nixl_cu12.mesonpy.libs" / "plugins" / "libplugin_UCX.so"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("readelf", "nm", "c++filt")), reason="binutils missing"
)


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def symbols(lib):
    """address -> mangled names, local symbols included (the vtable of a class in an anonymous
    namespace is local). An address can carry several names: GCC folds identical functions
    (our three supports*() all return true) into one body with aliases."""
    out = {}
    for line in run("nm", "--defined-only", str(lib)).splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.setdefault(int(parts[0], 16), []).append(parts[2])
    return out


def vtable(lib, vtable_symbol, slots):
    """For each of the first `slots` slots of vtable `vtable_symbol`, the demangled names of
    the function it points at."""
    syms = symbols(lib)
    start = next(a for a, names in syms.items() if vtable_symbol in names) + 16  # past the
    # offset-to-top and typeinfo words
    relocs = {}
    for line in run("readelf", "-rW", str(lib)).splitlines():
        parts = line.split()
        if len(parts) >= 4 and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            if parts[2] == "R_X86_64_RELATIVE":
                relocs[int(parts[0], 16)] = syms.get(int(parts[3], 16), [parts[3]])
            elif parts[2] == "R_X86_64_64":
                relocs[int(parts[0], 16)] = [parts[4].split("@")[0]]
    out = []
    for i in range(slots):
        names = relocs.get(start + 8 * i, ["?"])
        out.append(run("c++filt", *names).splitlines())
    return out


def method(signature):
    """'Cls::name(args) const' without the class: the part libnixl's call site depends on."""
    name_and_args = re.sub(r"^.*?(\w+|~\w+)(\(.*)$", r"\1\2", signature)
    return name_and_args.replace("~nixlUcxEngine", "~ENGINE").replace("~MultirailEngine", "~ENGINE")


# Slots 0-1 are the destructors, 2-26 nixlBackendEngine's virtual methods.
SLOTS = 27


def test_vtable_matches_the_wheels_engine(plugin_path):
    ours = vtable(plugin_path, "_ZTVN12_GLOBAL__N_115MultirailEngineE", SLOTS)
    theirs = vtable(UCX, "_ZTV13nixlUcxEngine", SLOTS)
    assert any("prepXfer" in n for n in theirs[11]), theirs[11]
    assert any("estimateXferCost" in n for n in theirs[26]), theirs[26]
    mismatched = [
        (i, o, t)
        for i, (o, t) in enumerate(zip(ours, theirs))
        if not {method(n) for n in o} & {method(n) for n in t}
    ]
    assert mismatched == [], "\n".join(f"slot {i}: ours {o}, wheel {t}" for i, o, t in mismatched)


def test_exports_only_the_entry_points(plugin_path):
    exported = {
        line.split()[-1]
        for line in run("nm", "-D", "--defined-only", str(plugin_path)).splitlines()
        if line.strip()
    }
    assert exported == {"nixl_plugin_init", "nixl_plugin_fini"}


def test_links_only_system_libraries(plugin_path):
    """One file: libmultirail is linked in, nothing outside the C and C++ runtimes is needed."""
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", run("readelf", "-d", str(plugin_path)))
    allowed = re.compile(r"^(libstdc\+\+|libgcc_s|libc|libm|libdl|libpthread|librt|ld-linux.*)\.so")
    assert [n for n in needed if not allowed.match(n)] == []
