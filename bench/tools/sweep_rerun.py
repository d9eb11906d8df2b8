"""Issue 44's attacks re-run, each in its own process with a deadline: classify each as
refused (a one-line error, exit 1 or 2), exact (checked against float64 by the snippet),
hang (deadline), crash (signal), noisy (a multi-line traceback that is not ours) or wrong."""
import json, os, shutil, subprocess, sys, tempfile, time, textwrap
from pathlib import Path

PRE = """
import torch, dilgen
torch.manual_seed(0)
SPEC = dilgen.Spec(name="s", num_heads=2, head_dim=16, dtype="float32", segment_lengths=[8, 16], dilation_rates=[1, 2])
K = dilgen.compile(SPEC)
def fail(msg):
    raise SystemExit("WRONG " + msg)
"""
A = []   # (item, name, kind, code): kind "py" (python snippet) or "cli" (dilgen argv as a python list)

for cu in ["[0, 8, 40]", "[0, -4, 20]", "[0, 8, 2**31 - 1]", "[0, 8, 16]", "[0, 12, 8, 20]", "[2, 8, 20]"]:
    A.append((3, f"compile packed cu_seqlens={cu}", "py", f"""
f = torch.compile(lambda q, cu: K(q, q, q, cu_seqlens=cu, max_seqlen=16), fullgraph=True, backend="aot_eager")
q = torch.randn(20, 2, 16)
out = f(q, torch.tensor({cu}, dtype=torch.int32))
fail("returned with no error; finite: %s" % torch.isfinite(out).all().item())
"""))
for w, r in [("2**20", 1), ("2**31 - 1", 3)]:
    A.append((4, f"decode w={w} r={r} over 50 rows", "py", f"""
from dilgen.reference import reference_attention
spec = dilgen.Spec(name="d", num_heads=2, head_dim=16, dtype="float32", causal=True, segment_lengths=[{w}, 8], dilation_rates=[{r}, 2])
q, k, v = (torch.randn(1, 50, 2, 16) for _ in range(3))
out = dilgen.compile(spec).decode(q[:, -1:], k, v, torch.tensor([50], dtype=torch.int32))
want = reference_attention(q, k, v, spec)[:, -1:]
e = ((out.double() - want).norm() / want.norm()).item()
print("EXACT" if e < 1e-5 else fail("rel err %g" % e))
"""))
A.append((5, "compile a FIFO", "cli", "['compile', FIFO]"))
A.append((5, "compile a link to /dev/zero", "cli", "['compile', ZERO]"))
A.append((5, "explain a FIFO", "cli", "['explain', FIFO]"))
A.append((5, "build a folder with a FIFO", "cli", "['build', FIFODIR, '--arch', 'interpreter']"))
A.append((7, "duplicate JSON key", "cli", "['compile', DUP]"))
A.append((7, "num_heads null", "cli", "['compile', NULLH]"))
A.append((7, "explain --png /dev/full", "cli", "['explain', GOOD, '--png', '/dev/full']"))
A.append((8, "explain --png x.txt", "cli", "['explain', GOOD, '--png', 'x.txt']"))
A.append((8, "DILGEN_DUMP_DIR a file", "cli", "['compile', GOOD]", ))
A.append((8, "DILGEN_CACHE_DIR=~nosuchuser/x (build)", "cli", "['build', SPECS, '--arch', 'sm90', '--seq-len', '64']"))
A.append((8, "DILGEN_CACHE_DIR=~nosuchuser/x (a call)", "py", "q = torch.randn(1, 16, 2, 16); K(q, q, q)\nfail('accepted')\n"))
ts = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "tests")!r})
import torchscale_model as tm
from dilgen.compat import torchscale as ts
args = lambda seg, dil: tm.make_args(seg, dil, embed_dim=32, heads=2)
"""
for seg in ["[8.7]", "'[2.5]'", "[True]", "'[1e400]'", "[[8]]", "\"[8,'a']\""]:
    A.append((7, f"torchscale segment_length={seg}", "py", ts + f"""
layer = ts.DilatedAttention(args({seg}, [1]), 32, 2, self_attention=True)
fail("accepted: %s" % (layer.spec.segment_lengths,))
"""))
A.append((7, "torchscale is_causal='no'", "py", ts + """
layer = ts.DilatedAttention(args([8], [2]), 32, 2, self_attention=True)
x = torch.randn(1, 8, 32)
layer(x, x, x, is_causal="no")
fail("accepted")
"""))
A.append((8, "torchscale patch(42)", "py", ts + "ts.patch(42)\nfail('accepted')\n"))
for name, code in [
    ("max_seqlen='abc'", "q = torch.randn(20, 2, 16); K(q, q, q, cu_seqlens=torch.tensor([0, 8, 20], dtype=torch.int32), max_seqlen='abc')"),
    ("padded mask on meta", "q = torch.randn(1, 16, 2, 16); K.padded(q, q, q, torch.zeros(1, 16, dtype=torch.bool, device='meta'))"),
    ("nested q", "n = torch.nested.nested_tensor([torch.randn(8, 2, 16), torch.randn(12, 2, 16)], layout=torch.jagged); K(n, n, n)"),
    ("double backward", "q = torch.randn(1, 16, 2, 16, requires_grad=True); o = K(q, q, q); g, = torch.autograd.grad(o.square().sum(), q, create_graph=True); g.sum().backward()"),
    ("nn num_heads=0", "dilgen.nn.MultiheadDilatedAttention(32, 0, segment_lengths=[8], dilation_rates=[1])"),
    ("nn segment_lengths=8", "dilgen.nn.MultiheadDilatedAttention(32, 2, segment_lengths=8, dilation_rates=[1])"),
    ("nn segment_lengths=None", "dilgen.nn.MultiheadDilatedAttention(32, 2, segment_lengths=None, dilation_rates=[1])"),
    ("nn wrong embed", "m = dilgen.nn.MultiheadDilatedAttention(32, 2, segment_lengths=[8], dilation_rates=[1]); m(torch.randn(1, 8, 48))"),
    ("nn float64 input", "m = dilgen.nn.MultiheadDilatedAttention(32, 2, segment_lengths=[8], dilation_rates=[1]); m(torch.randn(1, 8, 32, dtype=torch.float64))"),
    ("nn 2-D input", "m = dilgen.nn.MultiheadDilatedAttention(32, 2, segment_lengths=[8], dilation_rates=[1]); m(torch.randn(8, 32))"),
    ("KVCache(max_len=8.5)", "dilgen.nn.KVCache(1, 8.5, 2, 16)"),
    ("compiled bad shape (fullgraph)", "f = torch.compile(lambda q: K(q, q, q), fullgraph=True); f(torch.randn(1, 16, 3, 16))"),
]:
    A.append((8, name, "py", code + "\nfail('accepted')\n"))


def classify(rc, out, err, timed_out):
    if timed_out:
        return "hang"
    if rc < 0:
        return f"crash (signal {-rc})"
    if "WRONG" in out + err:
        return "wrong"
    if rc == 0:
        return "exact" if "EXACT" in out else "wrong (exit 0 without a check)"
    lines = [l for l in err.strip().splitlines() if l.strip()]
    last = lines[-1] if lines else ""
    if "Traceback" in err:                       # python snippet: our error is the last line
        mine = any(t in last for t in ("InputError", "SpecError", "ValueError", "TypeError", "RingError",
                                       "NotImplementedError", "CacheError", "RuntimeError"))
        internal = "InterpreterError" in last or "TorchRuntimeError" in last or "munmap" in err
        return "refused" if mine and not internal else f"noisy: {last[:160]}"
    if len(lines) == 1 and last.startswith("dilgen: error:") and rc == 2:
        return "refused"
    return f"noisy ({len(lines)} lines, exit {rc}): {last[:160]}"


def main(out_json):
    tmp = Path(tempfile.mkdtemp())
    fifo = tmp / "s.json"; os.mkfifo(fifo)
    fdir = tmp / "fifos"; fdir.mkdir(); os.mkfifo(fdir / "a.json")
    zero = tmp / "z.json"; zero.symlink_to("/dev/zero")
    dup = tmp / "dup.json"; dup.write_text('{"name": "a", "num_heads": 4, "num_heads": 8, "head_dim": 16, "segment_lengths": [8], "dilation_rates": [1]}')
    nullh = tmp / "n.json"; nullh.write_text('{"name": "a", "num_heads": null, "head_dim": 16, "segment_lengths": [8], "dilation_rates": [1]}')
    good = Path(__file__).resolve().parents[2] / "examples" / "specs" / "longnet_base.json"
    afile = tmp / "afile"; afile.write_text("x")
    names = dict(FIFO=str(fifo), FIFODIR=str(fdir), ZERO=str(zero), DUP=str(dup), NULLH=str(nullh), GOOD=str(good), SPECS=str(good.parent))
    rows = []
    for item, name, kind, code in A:
        env = dict(os.environ, DILGEN_CACHE_DIR=str(tmp / "cache"), OMP_NUM_THREADS="1")
        if name.startswith("DILGEN_DUMP_DIR"):
            env["DILGEN_DUMP_DIR"] = str(afile)
        if name.startswith("DILGEN_CACHE_DIR"):
            env["DILGEN_CACHE_DIR"] = "~nosuchuser/x"
        if kind == "cli":
            argv = [shutil.which("dilgen")] + eval(code, {}, names)
        else:
            argv = [sys.executable, "-c", PRE + textwrap.dedent(code)]
        t0 = time.monotonic()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=tmp)
            rc, out, err, to = p.returncode, p.stdout, p.stderr, False
        except subprocess.TimeoutExpired as e:
            rc, out, err, to = None, "", "", True
        verdict = classify(rc, out, err, to)
        last = (err.strip().splitlines() or [""])[-1][:200]
        rows.append(dict(item=item, attack=name, verdict=verdict, seconds=round(time.monotonic() - t0, 1), last_line=last))
        print(f"{item} {name:45s} {verdict:12s} {rows[-1]['seconds']:6.1f}s  {last[:110]}", flush=True)
    counts = {}
    for r in rows:
        key = r["verdict"].split(" ")[0].rstrip(":")
        counts[key] = counts.get(key, 0) + 1
    print(counts)
    Path(out_json).write_text(json.dumps(dict(rows=rows, counts=counts), indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
