"""Hand-written commentary for REPORT.md: where our numbers differ from the paper's, and why.

Written after reading a full run's results (``graphpipe eval all``); the numbers in the
tables and headlines always come from the result files, never from this text.
"""

NOTES: dict[str, str] = {
    "throughput": (
        "Same direction as the paper, larger on DLRM. Our baselines are sequential pipelines that relay "
        "every live activation through the chain (StageGraph.sequential), so they serialise the branches "
        "into 9-32 stages, while gpp runs branches side by side at depth 2-6 and picks a larger "
        "micro-batch. DLRM's embedding branches cost little compute under our analytical V100 model "
        "(embeddings are memory-bound; we charge only the per-op overhead), so serialising 14 branches "
        "into a deep pipeline costs SPP the most; the paper measured real kernels on Summit. GPipe "
        "re-materializes every stage, as in its paper; on 8 V100s that costs it 25% of its throughput "
        "(501 -> 377 samples/s) for a 6x smaller peak (10.0 -> 1.6 GB; `graphpipe plan mmt --strategy gpipe "
        "--devices 8 --batch-size 128 --recompute none|all`). Tables made before issue 15 show no GPipe "
        "row for MMT: activation bytes were then every tensor an op produced, with attention's seq x seq "
        "probabilities (meta tensors take the math path), 2.6x what autograd saves; they are now the "
        "saved bytes, as a run measures them, and plain GPipe fits too."),
    "search-time": (
        "Piper / gpp on MMT is 524-635x here, far above the paper's 9-21x and our own 15-21x of an earlier "
        "round (commit 2422f64: Piper 39-53 s, gpp 1.9-3.5 s). Both sides moved: gpp got 6-7x faster "
        "(issue 16), and Piper's search went to 222-377 s after it took its real planner's objective "
        "(msr-fiddle/piper algo.cpp, b4f4047) and the per-edge received bytes on its downset pairs "
        "(ced03e3). Our Piper is a Python reimplementation of an exhaustive DP over downset pairs, so the "
        "ratio is not a measurement of the paper's implementations; what carries over is the growth: "
        "Piper's state space is polynomial in downsets (n^k for k branches) and it refuses DLRM and "
        "CANDLE-Uno past its downset guard, as the paper reports. Searches over a minute are timed once "
        "(the repeats column). PipeDream's DP is faster than gpp on these graphs because its antichain "
        "space is small; gpp also simulates its top candidates. gpp scales sub-linearly with devices (its "
        "DP is indexed by pipeline depth, not device count): 0.8 s at 32 devices, 5.4 s at 1024. This host "
        "is noisy: the same code an hour earlier ran every unchanged case 30-50% faster (0.5 s at 32, 3.6 s "
        "at 1024), so compare versions side by side (evals/bench_gpp.py), not across tables. One outlier in "
        "the branch sweep: candle-uno with 4 branches at 32 devices takes 13.5 s, most of it PipeDream's "
        "antichain DP, which gpp runs for its sequential candidates (630 antichain states; 22 s before "
        "53a8cd1 made that DP 2.4x faster with bit-identical tables)."),
    "branches": (
        "The gain grows with the branch count and flattens near 1.9x at 16 branches (paper: up to 2x). "
        "With the micro-batch size fixed, MMT still gains 1.2-1.4x from the shallower pipeline alone. "
        "Piper is refused from 8 branches on (downsets)."),
    "ablation": (
        "Concurrent stages alone (gpp at the best SPP plan's micro-batch size) give most of the gain, as "
        "in the paper. Per-stage micro-batch sizes added nothing here: gpp's refinement found no "
        "improving per-stage change on these configs (the paper calls the gain incremental). The CP-SAT "
        "schedule splits each backward into I and W wherever no stage re-materializes (zero bubble, the "
        "default of `--schedule cpsat` since issue 17) and reorders F, I and W: +4% on MMT, +37% on DLRM and "
        "+7% on CANDLE-Uno over graph-1F1B, the same gains as the zero-bubble table's CP-SAT rows (MMT "
        "ends 1.8% from its bound in 20 s; DLRM and CANDLE-Uno are proven optimal). Without the split it "
        "added a few percent on MMT and nothing on the other two, where graph-1F1B was already optimal. "
        "DLRM's gains exceed the paper's band for the reason given under throughput."),
    "case-study": (
        "GPP halves the depth (6 -> 3, 6 stages -> 4 with the two branches side by side), as in the paper. "
        "The micro-batch goes the other way: PipeDream's is its optimizer's data-parallel share, batch / N "
        "= 16 (the real optimizer's choice, README \"PipeDream is its optimizer\"), where the paper's SPP "
        "baseline used 2; gpp picks 4. The gain is larger than the paper's (+55% vs +20%): the 6-deep "
        "1F1B pipeline with 8 micro-batches of 16 spends much of its iteration filling and draining ((K-1)/(M+K-1) = 5/13 for equal stages), "
        "where gpp's 3-deep graph of stages runs 32 micro-batches of 4."),
    "memory": (
        "gpp keeps far fewer micro-batches in flight (its depth). Peak memory is lower on MMT; on DLRM "
        "gpp's plan spends the saved in-flight budget on a 4x larger micro-batch, so its peak is higher "
        "but within the 16 GB device."),
    "fidelity": (
        "This table: 4 gloo ranks on the 2 cores of this host, so two ranks share each core; calibrated with "
        "`graphpipe profile` (ops timed in training order with gradient accumulation), a measured gloo link "
        "and the measured slowdown of the training step when k ranks compute at once. Time error median 38%, "
        "every plan measured slower than predicted. Since 0d4da37 the profile times an op's backward as one "
        "call, not as zero bubble's I then W: its per-op forward + backward now sums to 0.86-1.06x a "
        "single-process training step of these two models (three runs each; before: transformer 1.43-1.63x, "
        "candle-uno 0.91-1.18x) and to 1.07x / 1.14x on an H100 (fp32 / bf16; 1.52x / 2.02x before). The inflated backward had been absorbing the executor's "
        "own per-action costs, which the simulator does not charge: run alternately on this host, the old "
        "timing gave medians of 28% and 12%, the new 31% and 34%. On the 16 cores of lent machines (one core "
        "per rank, old timing) the median of the same five points was 17%, 21%, 13% and 26% in four runs; the "
        "per-plan errors at 8 ranks are in evals/results/device/. Memory error: activation bytes saved for "
        "backward, measured with saved_tensors_hooks on the same run, worst device per plan: 0 on all five."),
    "zero-bubble": (
        "Simulated only, with the cost model's I/W split (W = half of each parameterised op's backward, "
        "nothing for parameter-free ops; no profile here measures the split). graph-zb keeps graph-1F1B's "
        "peak activation bytes over devices by construction, so its peak memory equals graph-1F1B's on "
        "every point; its gain comes from producers waiting for the consumers' I instead of the whole B "
        "and from W's filling the drain. ZB-H1 lets later stages hold up to the first stage's 1F1B count "
        "(the paper's rule), which on the transformer's uneven stages (embedding and head) raises the "
        "fullest device's peak by up to 15% at 8 and 32 devices. Gains are below the paper's 1F1B / 3 "
        "bubble because gpp's plans already have small bubbles (many micro-batches per stage) and "
        "communication is not free. CP-SAT with split backward (10 s per point, 2 workers, the plan's "
        "micro-batch sizes) proves its schedule optimal on DLRM and CANDLE-Uno and ends within 0.2-2.5% of "
        "its bound on MMT; it gains 1.07-1.37x over graph-1F1B, up to 6% more than graph-zb (DLRM at 32 "
        "devices), by also reordering F and I. Its memory constraint is the device's, not graph-1F1B's "
        "peak: on DLRM and CANDLE-Uno it kept that peak (CANDLE-Uno at 8: +0.4%); on MMT the schedules it "
        "returns within 10 s vary between runs on this loaded host, from graph-1F1B's 3 micro-batches in "
        "flight on the fullest device (x1.00 the peak) to 5 (x1.33) and, in this run at 32 devices, 19 "
        "(x3.6, 5.8 GB of 16): near-optimal schedules differ in memory, and which one the solver "
        "returns in 10 s varies with the host's load. ZB-V and DualPipeV need their V: 2K single-device "
        "stages on K devices, where gpp's transformer plan has 3-4 stages with replicas, so the V is a "
        "deeper pipeline with 2.4-2.8x its bubble: 0.85x of 1F1B at 8 devices, 0.62x at 16 (and 64 "
        "stages do not fit 34 ops at 32). The two V schedules are within 0.3% of each other: in a "
        "simulator without DualPipe's communication overlap, pairing F with B buys nothing."),
    "async-throughput": (
        "Simulated (dedicated V100s): with no flush the fill and drain bubbles are paid once per run, not "
        "once per mini-batch, so 1f1b-async gains 1.5-1.7x over PipeDream-Flush on these plans; at 16 devices "
        "the transformer plan has a 3-way round-robin stage whose replicas all-reduce at every update (every 3 "
        "micro-batches), which 2bw pays once per m micro-batches, hence 2bw > 1f1b-async there. Stashing costs "
        "memory: 1f1b-async keeps K-i-1 extra weight versions on stage i (5.4 GB on the fullest device at 16), "
        "2bw at most one. Measured on 4 CPU ranks of this 2-core host shared with other jobs, the stream is "
        "not faster: PipeDream's 4-device plans of the small presets are data-parallel round-robin stages "
        "(candle-uno: one stage on 4 replicas, no pipeline at all), so the stream adds per-update all-reduces "
        "and removes no bubble; and with 4 ranks on 2 cores a pipeline bubble is not idle hardware (another "
        "rank computes in it), so removing it buys nothing. The simulator assumes dedicated devices; "
        "`--host-cores 2` models the shared host."),
    "staleness": (
        "A 4-stage cut of CANDLE-Uno (small, 2 branches) on 4 CPU ranks, 300 mini-batches of 8 micro-batches, "
        "SGD lr 0.05, seed 0; the task (the zoo's) drives the output's mean square to zero. The curves end "
        "within 1% of each other (mean of the last 30 steps); from step 20 on each step's loss is within 5.4% "
        "(1f1b-async) and 10.3% (2bw) of 1f1b's. 1f1b-async is ahead over the first steps (it updates after every "
        "micro-batch, so later micro-batches of mini-batch 0 already see updated weights); 2bw lags by about "
        "one mini-batch (its first two windows run on the initial weights, W(t+1) = W(t) - lr grad(W(t-1))). "
        "Weight stashing is "
        "what makes the gradients the ones of the replayed version schedule (`graphpipe run --check` passes "
        "with it and fails without, tests/test_async_runtime.py), but without it the loss here is not visibly "
        "worse: the inconsistency is second order in lr x gradient. Wall-clock: the streams ran 5.9-6.3x "
        "slower than the flushing 1f1b in this run (3.5-4.5x in the previous round's) on this oversubscribed "
        "host (4 ranks, 2 cores, other jobs; in an earlier round the same stream measured alone at 10/40/120 "
        "steps gave 101/123/114 ms per mini-batch against 86 ms for 1f1b): "
        "per-micro-batch functional_call and version bookkeeping, per-update work, and bubbles that were "
        "never idle cores. PipeDream's time-to-accuracy gain needs dedicated devices (not measured here). "
        "Memory: stashing cost 19.2 kB on stage 0 (3 versions of its 6.4 kB of weights), 2bw 8.3 kB (one "
        "version of stage 2's), measured equal to the prediction."),
    "memory-runtime": (
        "Run on 4 gloo ranks of a shared 2-core host, 2 steps after 1 warm-up, micro-batch 2, batch 8; the bytes are "
        "exact on CPU (saved_tensors_hooks), so host load does not move them. Two things made the model miss "
        "before (worst 3200%, 12 of 90 runs off by more than 10%): a cut between an op that saves its output (a "
        "ReLU) and the next op saving the same tensor as its input (the Linear after it) leaves two copies where "
        "one device had one -- now each graph edge carries the bytes its consumer saves of it beyond the act_bytes "
        "already charged (`saved_bytes`) and the receiving stage is charged them; and embedding_bag's meta kernel "
        "saves an int64 per index that the CPU kernel does not, so capture counts the CPU kernel's saves. "
        "Re-materialization is below none on the fullest device in 27 of 45 pairs. The 18 others are single-stage "
        "data-parallel plans (gpp and pipedream on dlrm, candle-uno and twobranch: 4 replicas, one micro-batch "
        "each): with one micro-batch in flight re-materializing keeps the same working set and adds the stashed "
        "stage inputs -- equal here, where the input is the iteration's data (resident, not counted), larger by "
        "the received input on a later stage. Three more pairs (graph-1F1B on pipedream's two round-robin "
        "stages) were in that list until graph-1F1B gave each round-robin replica its own warm-up: it used to "
        "share the stage's warm-up between the replicas, one micro-batch each. The model predicts both exactly, so `--recompute "
        "auto` does not choose it there. The time error in the result file is against the v100 preset the plans "
        "were made for; `graphpipe eval fidelity` gives the calibrated time error beside the memory error."),
}
