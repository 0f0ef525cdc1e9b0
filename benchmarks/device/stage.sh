#!/usr/bin/env bash
# One stage of a GPU session on the lent device, run from the repository root copy:
#   bash benchmarks/device/stage.sh <stage> [commit]
# Stages (each writes under $OUT and prints a short tail):
#   kernels   attention shape (b), capture probe when its capture failed, kernel GPU tests, fp8 GEMM benchmark
#   calib     calibration variants re-measured / fresh held-out set (needs TorchRec: fbgemm parts in /tmp/fb)
#   fp8train  500+ steps bf16 vs fp8 (needs TorchRec); $GPUS picks the GPUs of the two arms (default 0,0)
#   train     trainer benchmark cases (needs TorchRec)
#   draws     the fresh one-GPU draws of the plan set for the GPU lent (H200: $H200_PLANS, default fresh_plans_e;
#             H100: $H100_PLANS, default fresh_plans_h100h; both held out, planned at the commit their manifest records), within $BUDGET s (default 420), a partial result
#             after each draw (a draw gets $RUN_TIMEOUT s, default 200: the session's first one compiles Triton's kernels cold); $CONTINUE (an earlier result in the tree, a path from its root) keeps its measured draws;
#             $TRAIN_ARGS: a development variant's coplan train switches (result *_variant.json) (needs TorchRec);
#             the run directories come back as draw_runs_<gpu>[_variant].tgz (traces gzipped, no checkpoints); on CPU
#             afterwards, scripts/ship_calibration.py --runs <that tgz> refits the shipped calibration from them (the
#             next set, not this one, is then its held-out test)
#   ab        dense arch only (no TorchRec): --compile off vs layers under CUDA graphs ($AB_PLANS), then the graphs' GPU test
#   film      the fused FiLM LayerNorm's GPU tests and benchmarks/film_norm.py (no TorchRec needed), then the attention
#             kernels' GPU tests at head dims that are not a power of two and benchmarks/attention_head_pad.py
#   fp8fused  the fused FP8 producers' GPU tests and benchmarks/fp8_fused_h200.py (no TorchRec needed; result fp8_fused_<gpu>.json)
#   startup   time to the first step of gem-h200, first and repeated run (H200 only: its plan is for h200-1gpu)
# The device copy's git HEAD is stale, so the commit is passed in and recorded by the scripts.
# The trainer benchmarks run plans made by the planner, which needs OR-Tools (not on the device): make
# them beforehand, in the working tree that travels, with the same arguments and --plan-only, e.g.
#   python benchmarks/train_h200.py --plan-only --plans benchmarks/results/plans
#   python benchmarks/calibration_h200.py --plan-only --variant-set all --plans benchmarks/results/plans
#   python benchmarks/fp8_train_h200.py --plan-only --recipe blockwise --fp8-layers interformer.0,... --plans benchmarks/results/plans
# ($PLANS names another folder.)
set -uo pipefail
stage=$1; commit=${2:-unknown}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COPLAN_GIT_COMMIT=$commit
bash benchmarks/device/setup.sh 2>&1 | tail -n 1
rm -rf /tmp/tests && cp -r tests pyproject.toml /tmp/
root=$(pwd); cd /tmp && export PYTHONPATH=/tmp/pkg:/tmp/site
PLANS=${PLANS:-benchmarks/results/plans}  # under /tmp/benchmarks: setup.sh copies the tree's benchmarks/ there
t() { echo "[$(date -u +%H:%M:%S)] $*"; }
case $stage in
kernels)
  t attention; timeout 130 python3 benchmarks/attention.py --shapes b --quick --precompile 12 --timeout 110 --out $OUT/attention_b.json > $OUT/attention_b.log 2>&1; tail -n 6 $OUT/attention_b.log
  if grep -q '"graph_error": "' $OUT/attention_b.json 2>/dev/null; then
    t probe; timeout 100 python3 benchmarks/device/capture_probe.py --timeout 90 --out $OUT/capture_probe.json > $OUT/capture_probe.log 2>&1; tail -n 12 $OUT/capture_probe.log
  fi
  t tests; timeout 160 python3 -m pytest -q -rfxXs --tb=line -p no:cacheprovider tests/kernels/test_cuda_graph.py tests/kernels/test_fp8.py tests/kernels/test_launch.py > $OUT/pytest_kernels.txt 2>&1; tail -n 15 $OUT/pytest_kernels.txt
  t fp8; timeout 190 python3 benchmarks/fp8_h200.py --commit $commit --timeout 150 --out $OUT/fp8_h200.json > $OUT/fp8_h200.log 2>&1; tail -n 8 $OUT/fp8_h200.log
  ;;
ab)
  # no TorchRec needed: the dense arch alone, layers eager vs compiled under CUDA graphs, then the graphs' GPU test
  t ab; timeout ${BUDGET:-230} python3 benchmarks/dense_graphs_ab.py --plans benchmarks/results/${AB_PLANS:-fresh_plans_c_ab} \
    --budget-s $(( ${BUDGET:-230} - 15 )) --case-timeout ${CASE_TIMEOUT:-110} --out $OUT/dense_graphs_ab.json > $OUT/dense_graphs_ab.log 2>&1
  grep -E "^seed" $OUT/dense_graphs_ab.log | cut -c1-300; tail -n 3 $OUT/dense_graphs_ab.log
  t tests; timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -rfxXs --tb=short -p no:cacheprovider tests/trainer/test_graphs.py -k on_the_gpu > $OUT/pytest_graphs.txt 2>&1; tail -n 25 $OUT/pytest_graphs.txt
  ;;
probe)
  # Two GPUs at once: attention (a, b) then the kernel GPU tests on GPU 0; the compile probe then the fp8 GEMMs on GPU 1.
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 240 python3 benchmarks/attention.py --shapes ${SHAPES:-a,b} --quick --precompile 12 --timeout 220 --methods ${METHODS:-triton_softmax,triton_gdpa_silu} --out $OUT/attention.json > $OUT/attention.log 2>&1
    timeout 170 python3 -m pytest -q -rfxXs --tb=line -p no:cacheprovider tests/kernels/test_cuda_graph.py tests/kernels/test_fp8.py tests/kernels/test_launch.py > $OUT/pytest_kernels.txt 2>&1 ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 300 python3 benchmarks/compile_probe.py --device cuda --workload gem-h200 --timeout 280 --case-timeout 200 --out $OUT/compile_probe_cuda.json > $OUT/compile_probe.log 2>&1
    timeout 200 python3 benchmarks/fp8_h200.py --commit $commit --timeout 160 --out $OUT/fp8_h200.json > $OUT/fp8_h200.log 2>&1 ) &
  wait; for f in attention.log pytest_kernels.txt compile_probe.log fp8_h200.log; do echo "== $f"; tail -n 10 $OUT/$f; done
  ;;
pair)
  # Two jobs at once, one per GPU. GPU 0: $JOB0, GPU 1: $JOB1, each one of
  #   train            trainer benchmark cases ($TRAIN_ARGS<gpu> or $TRAIN_ARGS, budget $BUDGET) -> train_h200_g<gpu>.json
  #   calib:<v1,v2..>  calibration runs of those variants (analysis here later)
  #   fp8train         bf16 vs fp8 arms on that GPU ($RECIPE, $STEPS, $FP8_ARGS)
  #   kern             fp8 GPU tests and GEMM benchmark ($FP8_RECIPES), attention ($METHODS)
  #   none             nothing
  job() {
    local gpu=$1 spec=$2 tag=g$1
    # (the calibration and fp8 scripts set CUDA_VISIBLE_DEVICES of their children from their own GPU lists,
    #  which index the parent's visible devices)
    export CUDA_VISIBLE_DEVICES=$gpu
    case $spec in
      train) local ta=TRAIN_ARGS$gpu  # TRAIN_ARGS0 / TRAIN_ARGS1 when both GPUs train (else TRAIN_ARGS)
             timeout 570 python3 benchmarks/train_h200.py --plans $PLANS --runs-root /tmp/bench$gpu --timeout ${BUDGET:-480} ${!ta:-${TRAIN_ARGS:-}} --out $OUT/train_h200_$tag.json > $OUT/train_$tag.log 2>&1 ;;
      calib:*) timeout 570 python3 benchmarks/calibration_h200.py --plans $PLANS --gpus 1 --only ${spec#calib:} --steps ${CALIB_STEPS:-16} --data-batches ${CALIB_DATA_BATCHES:-8} --budget-s ${CALIB_BUDGET:-520} --analysis-reserve-s 20 --port $(( 29610 + 100 * gpu )) \
                 --runs-root /tmp/calib$gpu --keep $OUT/runs_$tag --out $OUT/calib_$tag.json > $OUT/calib_$tag.log 2>&1
               (cd $OUT && tar czf runs_$tag.tgz runs_$tag && rm -rf runs_$tag) ;;
      kern) timeout 150 python3 benchmarks/attention.py --shapes a,b --quick --precompile 12 --timeout 130 --methods ${METHODS:-triton_gdpa_silu,triton_softmax} --out $OUT/attention.json > $OUT/attention.log 2>&1
            timeout 120 python3 -m pytest -q -rfxXs --tb=line -p no:cacheprovider tests/kernels/test_fp8.py tests/kernels/test_fp8_block_rules.py tests/kernels/test_fp8_torchao.py > $OUT/pytest_kernels.txt 2>&1
            timeout ${FP8_GEMM_S:-280} python3 benchmarks/fp8_h200.py --commit $commit --recipes ${FP8_RECIPES:-torchao-tensorwise,torchao-rowwise,blockwise} --timeout $(( ${FP8_GEMM_S:-280} - 30 )) --out $OUT/fp8_h200.json > $OUT/fp8_h200.log 2>&1 ;;
      fp8train) timeout 570 python3 benchmarks/fp8_train_h200.py --plans $PLANS --gpus $gpu,$gpu --recipe ${RECIPE:-rowwise} --steps ${STEPS:-510} ${FP8_ARGS:-} \
                 --fp8-layers interformer.0,interformer.1,interformer.2,interformer.3 --runs-root /tmp/runs/fp8 --timeout 550 --out $OUT/fp8_train_h200.json > $OUT/fp8train.log 2>&1 ;;
    esac
  }
  (job 0 "${JOB0:-none}") & (job 1 "${JOB1:-none}") & wait   # 'none': that GPU idles (e.g. a one-GPU lease)
  for f in train_g0.log train_g1.log calib_g0.log calib_g1.log attention.log pytest_kernels.txt fp8_h200.log fp8train.log; do [ -f $OUT/$f ] && { echo "== $f"; tail -n 14 $OUT/$f; }; done
  ;;
calib)
  t calib; timeout 560 python3 benchmarks/calibration_h200.py --plans $PLANS --gpus ${NGPU:-1} --only ${ONLY:-ref-b8,ref-b8-h512,ref-b12-h768,b48-h768,d896-L5,rc-L3-b48,nomoe-b48-h1280,h2048-b16} \
    --budget-s ${BUDGET:-500} --analysis-reserve-s 40 --runs-root /tmp/calib2 --keep $OUT/runs --out $OUT/calibration_h200_remeasure.json > $OUT/calib.log 2>&1
  tail -n 15 $OUT/calib.log; (cd $OUT && tar czf runs.tgz runs && rm -rf runs)
  ;;
fp8train)
  t fp8train; timeout 580 python3 benchmarks/fp8_train_h200.py --plans $PLANS --gpus ${GPUS:-0,0} --recipe ${RECIPE:-blockwise} --steps ${STEPS:-510} \
    --fp8-layers interformer.0,interformer.1,interformer.2,interformer.3 --runs-root /tmp/runs/fp8 --timeout 560 --out $OUT/fp8_train_h200.json > $OUT/fp8train.log 2>&1
  tail -n 15 $OUT/fp8train.log
  ;;
train)
  t train; timeout 580 python3 benchmarks/train_h200.py --plans $PLANS --runs-root /tmp/bench --timeout ${BUDGET:-330} ${TRAIN_ARGS:-} --out $OUT/train_h200.json > $OUT/train.log 2>&1
  tail -n 25 $OUT/train.log
  ;;
draws)
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  case $gpu in
    *H200*) plans=${H200_PLANS:-fresh_plans_e}; tag=h200 ;;
    *H100*) plans=${H100_PLANS:-fresh_plans_h100h}; tag=h100 ;;
    *) echo "no plan set for '$gpu'"; exit 2 ;;
  esac
  t "draws: $gpu, plans $plans"
  timeout 580 python3 benchmarks/fresh_draws_h200.py --plans benchmarks/results/$plans --runs-root /tmp/draws \
    --budget-s ${BUDGET:-420} --run-timeout-s ${RUN_TIMEOUT:-200} ${CONTINUE:+--continue-from $root/$CONTINUE} \
    ${TRAIN_ARGS:+"--train-args=$TRAIN_ARGS"} --out $OUT/fresh_draws_$tag${TRAIN_ARGS:+_variant}.json > $OUT/draws.log 2>&1
  grep -E "^seed|median|min_local" $OUT/draws.log | cut -c1-400
  # the runs themselves (traces gzipped, no checkpoints), for `coplan calibrate` and per-op analysis off the device
  if [ -d /tmp/draws ]; then
    find /tmp/draws -name 'rank*.json' -path '*/traces/*' -exec gzip -f {} \;
    tar czf $OUT/draw_runs_$tag${TRAIN_ARGS:+_variant}.tgz --exclude=checkpoints -C /tmp draws && ls -la $OUT/*.tgz
    rm -rf /tmp/draws
  fi
  ;;
film)
  # the fused FiLM LayerNorm: its GPU tests, then fused vs PyTorch forward + backward at draws' shapes
  t tests; COPLAN_KERNEL_TESTS_PRECOMPILE=0 timeout 120 python3 -m pytest -q -rfxXs --tb=short -p no:cacheprovider tests/kernels/test_film_norm.py > $OUT/pytest_film.txt 2>&1; tail -n 8 $OUT/pytest_film.txt
  t bench; timeout 200 python3 benchmarks/film_norm.py --out $OUT/film_norm.json > $OUT/film_norm.log 2>&1; tail -n 10 $OUT/film_norm.log
  t attn_tests; COPLAN_KERNEL_TESTS_PRECOMPILE=0 timeout 150 python3 -m pytest -q -rfxXs --tb=short -p no:cacheprovider tests/kernels/test_triton_attention.py -k "power or strided or low_precision" > $OUT/pytest_attn.txt 2>&1; tail -n 6 $OUT/pytest_attn.txt
  t attn_pad; timeout 200 python3 benchmarks/attention_head_pad.py --out $OUT/attention_head_pad.json > $OUT/attention_head_pad.log 2>&1; tail -n 10 $OUT/attention_head_pad.log
  ;;
fp8fused)
  # issue 26, no TorchRec needed: the fused FP8 producers' GPU tests, then benchmarks/fp8_fused_h200.py at the GPU's topology
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  case $gpu in *H100*) topo=h100-1gpu; tag=h100 ;; *) topo=h200-1gpu; tag=h200 ;; esac
  t tests; COPLAN_KERNEL_TESTS_PRECOMPILE=0 timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rfxXs --tb=short -p no:cacheprovider tests/kernels/test_fp8_fused.py > $OUT/pytest_fp8_fused.txt 2>&1; tail -n 8 $OUT/pytest_fp8_fused.txt
  t bench; timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/fp8_fused_h200.py --topology $topo --commit $commit --out $OUT/fp8_fused_$tag.json > $OUT/fp8_fused.log 2>&1; tail -n 16 $OUT/fp8_fused.log
  ;;
startup)
  t startup; timeout 560 python3 benchmarks/startup_h200.py --runs-root /tmp/startup --out $OUT/startup_h200.json > $OUT/startup.log 2>&1
  tail -n 12 $OUT/startup.log
  ;;
esac
t done
