#!/usr/bin/env bash
# GPU checks of compiled stages and early-posted receives (one short run on a lent GPU machine).
#
#   OUT=/some/folder bash evals/gpu_check.sh      # PYTHON=..., GPU_CHECK_MODEL=zoo-spec to override
#
# Parts (each may fail without stopping the others; a summary is printed at the end):
#   1. --compile --check on one GPU: a two-stage plan of transformer:small, all stages on one rank, trained
#      compiled and compared with single-process eager training (loss and every gradient).
#   2. bench_api --compile on one GPU: the API eager and compiled against the plain loop eager and
#      compiled (torch.compile), alternating steps, medians, ratios side by side in one run (fp32, then bf16).
#   3. Early-posted receives (NCCL, needs >= 2 GPUs): the same 2-rank 1f1b plan run with receives posted at
#      use and posted one action ahead, alternating, median iteration times; a torch.profiler trace of the
#      early-posting run (NCCL SendRecv kernels on their own streams beside the compute kernels).
#      Skipped, saying so, on a machine with one GPU (NCCL cannot pair two ranks on one GPU).
set -x
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
$PY -c "import networkx, scipy, numpy" || echo "WARNING: graphpipe's planning needs networkx, scipy and numpy"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A STATUS
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
    > "$OUT/torch.txt" 2>&1

timeout 150 $PY - > "$OUT/1-compile-check.txt" 2>&1 <<'PYEOF'
import torch
from graphpipe import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.worker import run_job
import torch.distributed as dist
from graphpipe.runtime.launch import free_port

spec = "transformer:small"
graph = zoo.load_graph(spec)
groups = (["embed", "layer0", "layer1"], ["layer2", "layer3", "head"])
stages = [Stage(i, tuple(graph.op_id(n) for n in g), (0,), 4) for i, g in enumerate(groups)]
sg = StageGraph.build(graph, stages, 16, 1, allow_shared_devices=True)
cluster = preset("h100", 1)
plan = Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster, strategy="custom",
            schedule=make_schedule("gpipe", sg, cluster))
cuda = torch.cuda.is_available()
backend, device = ("nccl", torch.device("cuda:0")) if cuda else ("gloo", torch.device("cpu"))
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
if cuda:
    torch.cuda.set_device(0)
control = dist.new_group(backend="gloo") if cuda else None  # barriers and figures travel on CPU tensors
result = run_job(0, 1, plan, RunOptions(steps=3, check=True, compile=True, backend=backend), device, backend, control)
check = result.check
print("compile --check passed:", check.passed, "params", check.num_params_checked, "/", check.num_params,
      "max_abs_diff", check.max_abs_diff, "loss", check.loss, "reference", check.reference_loss)
raise SystemExit(0 if check.passed else 1)
PYEOF
STATUS[compile-check]=$?

# a GPT-style model of about 100M parameters: big enough that the GPU, not the host, sets the step time
GPT=${GPU_CHECK_MODEL:-"transformer:small,layers=8,hidden=1024,seq=256,heads=16,ffn=4096,vocab=1024"}
timeout 170 $PY -m evals.bench_api --model "$GPT" --batch-size 64 --micro-batch-size 8 --compile --no-torch \
    --steps 16 --warmup 3 --out "$OUT" > "$OUT/2-bench-compile-fp32.txt" 2>&1
STATUS[bench-compile-fp32]=$?
timeout 150 $PY -m evals.bench_api --model "$GPT" --batch-size 64 --micro-batch-size 8 --compile --no-torch \
    --steps 16 --warmup 3 --precision bf16 --out "$OUT" > "$OUT/2-bench-compile-bf16.txt" 2>&1
STATUS[bench-compile-bf16]=$?

GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 2 ]; then
  timeout 200 $PY -m evals.overlap_sends --out "$OUT" > "$OUT/3-overlap.txt" 2>&1
  STATUS[overlap-sends]=$?
else
  echo "skipped: early-posted receives need 2 GPUs (NCCL cannot pair two ranks on one GPU); this machine has ${GPUS:-0}" \
      > "$OUT/3-overlap.txt"
  STATUS[overlap-sends]=skipped
fi

# FSDP and TP stages (fully_shard / DTensor over NCCL): the stage-parallel eval's plans, checked against one
# process; 4 ranks, one per GPU (NCCL cannot pair two ranks on one GPU)
if [ "${GPUS:-0}" -ge 4 ]; then
  $PY - "$OUT" <<'PYEOF' > "$OUT/4-sharded.txt" 2>&1
import sys
from graphpipe.evals.stage_parallel_run import _plan
from graphpipe.plan import write_plan
for layout in ("pp-fsdp", "pp-tp"):
    write_plan(f"{sys.argv[1]}/{layout}.json", _plan(layout))
PYEOF
  timeout 200 $PY -m graphpipe run "$OUT/pp-fsdp.json" --check --steps 3 >> "$OUT/4-sharded.txt" 2>&1 \
    && timeout 200 $PY -m graphpipe run "$OUT/pp-tp.json" --check --steps 3 >> "$OUT/4-sharded.txt" 2>&1
  STATUS[sharded-stages]=$?
else
  echo "skipped: FSDP and TP stages need 4 GPUs here (2 stages x 2 ranks); this machine has ${GPUS:-0}" \
      > "$OUT/4-sharded.txt"
  STATUS[sharded-stages]=skipped
fi

set +x
echo "==== summary ===="
for part in compile-check bench-compile-fp32 bench-compile-bf16 overlap-sends sharded-stages; do
  echo "$part: ${STATUS[$part]} (0 = ok)"
done
for f in "$OUT"/1-*.txt "$OUT"/2-*.txt "$OUT"/3-*.txt "$OUT"/4-*.txt; do echo "--- $f"; tail -4 "$f"; done
