// Declares every op of the `demb` torch library once. Kernels register per dispatch key in
// cpu/*.cpp and cuda/*.cu; fake (meta) kernels are registered in Python (demb_kernels/_fakes.py
// and beside the wrappers; `import demb_kernels` registers them all). A schema names every
// argument an op writes, (a!) and so on (tests/test_opcheck.py checks them).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(demb, m) {
  m.def("hash64(Tensor keys) -> Tensor");
  m.def(
      "route_keys(Tensor keys, int world_size, str dist_type, int block_size) -> "
      "(Tensor, Tensor)");
  m.def(
      "bucketize_by_owner(Tensor lengths, Tensor values, Tensor? weights, int world_size, "
      "str dist_type, Tensor? block_sizes) -> (Tensor, Tensor, Tensor?, Tensor)");
  // The scored hash table (docs/hash_table.md). The first six arguments are the index tensors;
  // the inserting ops also take the optional victim ranks last: victim_rank (S,) int64 per-slot
  // ranks and ranked (T,) int64 per-table flags (nonzero: the table's victims are the lowest
  // rank, ties to the first in circular order), each None or (0,) when no table ranks.
  m.def(
      "table_lookup(Tensor index_keys, Tensor digests, Tensor(a!) scores, Tensor slot_offsets, "
      "Tensor bucket_widths, Tensor policies, Tensor keys, Tensor table_ids, Tensor? score_args, "
      "Tensor? counts) -> Tensor");
  m.def(
      "table_find_or_insert(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids, Tensor score_args, Tensor? counts, Tensor? victim_rank=None, "
      "Tensor? ranked=None, bool wait=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // find_or_insert that also gathers each of N occurrences' row (gather_table_rows of the
  // slots it found, through `inverse`) when every key was found; else rows is (0, dim). On
  // CUDA the gather is queued before the host waits for the all-found flag.
  m.def(
      "table_find_or_insert_rows(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids, Tensor score_args, Tensor? counts, Tensor[] values, Tensor inverse, "
      "int dim, Tensor? victim_rank=None, Tensor? ranked=None) -> (Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor)");
  // find_or_insert of dedup_launch's outputs (CUDA only): phase A gated on the device by its
  // info words, the gather queued, then info read back (the one sync), then phase B if needed.
  m.def(
      "table_find_or_insert_gated(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids, Tensor score_args, Tensor? counts, Tensor(e!) info, Tensor[] values, "
      "Tensor? inverse, int dim, Tensor? victim_rank=None, Tensor? ranked=None) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "table_insert_or_assign(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids, Tensor assign_scores, Tensor? victim_rank=None, Tensor? ranked=None) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "table_erase(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids) -> Tensor");
  m.def("table_timestamp(Tensor like, int count=1) -> Tensor");
  // A lookup that also reads each found key's row (float32; zeros for a missing key).
  m.def(
      "table_find_rows(Tensor index_keys, Tensor digests, Tensor scores, Tensor slot_offsets, "
      "Tensor bucket_widths, Tensor policies, Tensor[] values, Tensor keys, Tensor table_ids, "
      "int dim) -> (Tensor, Tensor)");
  // table_find_rows of a TBE-layout batch: each index's table is its feature's; with check,
  // the batch's data checks of dedup_batch raise before anything is returned.
  m.def(
      "table_find_batch_rows(Tensor index_keys, Tensor digests, Tensor scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor policies, Tensor[] values, "
      "Tensor indices, Tensor offsets, Tensor feature_tables, int batch_size, int dim, "
      "bool check=False) -> (Tensor, Tensor)");
  // The online-delta paths' CPU kernels (cpu/slot_writes_cpu.cpp; on CUDA the Python paths of
  // demb_storage run tensor ops instead). table_export_scan -> (slots, keys, words, counts): the
  // slots of tables table_ids (in that order) holding a key whose score word `word` is at least
  // the table's min_scores entry, table-local, with their keys and score words `words` ((n,
  // len(words))), and (len(table_ids),) counts per table. slot_writes_check -> (digests,
  // flags): each key's digest, and five flags (the empty key, a (key, table) twice, a slot
  // outside its table, a (slot, table) twice, a slot outside its key's home bucket).
  // slot_writes_apply writes checked keys at their slots with (W, N) index words; -> (N,) bool:
  // the slot held another key or none before.
  m.def(
      "table_export_scan(Tensor index_keys, Tensor scores, Tensor slot_offsets, int[] table_ids, "
      "int[] min_scores, int word, int[] words) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "slot_writes_check(Tensor slot_offsets, Tensor bucket_widths, Tensor keys, "
      "Tensor table_ids, Tensor slots) -> (Tensor, Tensor)");
  m.def(
      "slot_writes_apply(Tensor(a!) index_keys, Tensor(b!) digests, Tensor(c!) scores, "
      "Tensor slot_offsets, Tensor bucket_widths, Tensor(d!) sizes, Tensor keys, "
      "Tensor table_ids, Tensor slots, Tensor key_digests, Tensor words) -> Tensor");
  // Value rows addressed by slot (-1: none).
  m.def("gather_rows(Tensor values, Tensor slots) -> Tensor");
  m.def("scatter_rows(Tensor(a!) values, Tensor slots, Tensor rows) -> ()");
  // The same for several buffers in one call (CPU only: on the CPU each call's parallel region
  // costs more than a small table's copy; demb_kernels.rows loops on CUDA).
  m.def("gather_rows_many(Tensor[] values, Tensor[] slots) -> Tensor[]");
  m.def("scatter_rows_many(Tensor(a!)[] values, Tensor[] slots, Tensor[] rows) -> ()");
  // Initial value rows from their keys: a counter-based generator (init_rule.h). The mode is
  // named init_mode, not mode: torch.compile's auto_functionalized_v2 takes a `mode` of its own
  // and a mutable op's argument of that name collides with it (init_rows.py passes it by
  // position).
  m.def(
      "init_rows(Tensor(a!) values, Tensor slots, Tensor keys, int dim, int seed, str init_mode, "
      "float mean, float std_dev, float lower, float upper, float value, Tensor? state) -> ()");
  // The rows find_or_insert gave new keys (status INSERTED or EVICTED), for several tables in
  // one call: modes are init_rows' modes as codes, params 5 words per table (mean, std_dev,
  // lower, upper, value).
  m.def(
      "init_new_rows(Tensor(a!)[] values, Tensor slots, Tensor keys, Tensor tables, "
      "Tensor status, int[] dims, int[] seeds, int[] modes, float[] params, Tensor?[] states) "
      "-> ()");
  // A table module step: rows of several tables gathered per occurrence, and gradients summed
  // per unique key in a fixed order (lookup_rule.h).
  m.def(
      "gather_table_rows(Tensor[] values, Tensor slots, Tensor tables, Tensor? inverse, "
      "int dim) -> Tensor");
  m.def("segment_plan(Tensor starts, int n) -> Tensor");
  // A pooled lookup's bags (SUM, or MEAN) summed straight from the tables' rows by each index's
  // slot, in index order (pool_checks.h).
  m.def(
      "pool_table_rows(Tensor[] values, Tensor slots, Tensor offsets, Tensor feature_tables, "
      "int batch_size, int dim, bool mean, Tensor? weights) -> Tensor");
  // Which build of pool_table_rows' CPU kernel runs in this process: "avx2" or "portable"
  // (cpu/pool_cpu.cpp; no tensors, one kernel for every backend).
  m.def("pool_cpu_build() -> str");
  // The calling thread's intra-op threads for CPU kernels from now on; returns the count
  // before (cpu/threads_cpu.cpp; no tensors, one kernel for every backend). Other threads
  // keep theirs. Where PyTorch does not use OpenMP it only returns the count.
  m.def("set_thread_intra_op_threads(int threads) -> int");
  m.def(
      "segment_sum_rows(Tensor grads, Tensor order, Tensor starts, Tensor? plan=None, "
      "Tensor? rows=None, Tensor? scale=None, bool skip_single=False) -> (Tensor, Tensor)");
  // Each segment's only entry's grads row (order[starts[u]]), -1 where a segment has several:
  // the rows an update reads straight from the gradient when the sums skip them.
  m.def("segment_single_rows(Tensor order, Tensor starts) -> Tensor");
  // -> (rows, counts, bounds, key bits): rows (5, N) int64 holds inverse, order, keys, tables
  // and starts, the last three in their first U entries, zeros after (one buffer: the wrapper
  // takes views); counts (U,); bounds and key bits on the CPU.
  m.def(
      "dedup_batch(Tensor indices, Tensor offsets, Tensor feature_tables, int num_tables, "
      "int batch_size, Tensor? counters, int key_bits=64) -> (Tensor, Tensor, Tensor, Tensor)");
  // dedup_batch's rows and counts at full size, with no sync (CUDA only), and `info`: U and the
  // checks stay in its words on the device (cuda/dedup_cuda.cu); counts=False: no counts (a
  // (0,) tensor in their place); info's last 1 + clock_words words are a zeroed word for a
  // backward's NaN/inf flag (summed_update's `nonfinite`, its first byte) and clock_words
  // copies of the GPU's global timer, read by the first kernel.
  m.def(
      "dedup_launch(Tensor indices, Tensor offsets, Tensor feature_tables, int num_tables, "
      "int batch_size, Tensor? counters, int key_bits=64, int key_radix=0, bool counts=True, "
      "int clock_words=0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "index_tables(Tensor indices, Tensor offsets, Tensor feature_tables, int num_tables, "
      "int batch_size) -> (Tensor, Tensor)");
  m.def("batch_bounds(Tensor host, int n, int num_tables, int features) -> Tensor");
  m.def("status_counts(Tensor status, int[] bounds) -> Tensor");
  // Optimizer updates of value rows [embedding | state] in place (demb_optim's specs). With
  // grad_rows ((sum of n_t,) int64, the tables' entries in order), an entry whose row r is not
  // -1 reads its gradient from grad_source[r] instead of grads[t].
  m.def(
      "optimizer_update(Tensor(a!)[] values, Tensor[] slots, Tensor[] grads, int[] dims, "
      "int[] steps, str optimizer, float learning_rate, float eps, float beta1, float beta2, "
      "float weight_decay, float learning_rate_power, float ftrl_beta, float l1_reg, "
      "float l2_reg, Tensor? skip=None, Tensor? grad_rows=None, Tensor? grad_source=None) "
      "-> ()");
  // A table module's rows wired to its update (an Autograd kernel only, summed_update.cpp): the
  // identity on `out`, whose backward sums each unique key's gradient (segment_sum_rows) and
  // runs optimizer_update on the tables in place; `steps` (CPU) advances after each update. On
  // the CPU the sums go into `workspace` when given (resized; a module keeps it across steps).
  // On CUDA `nonfinite`, a zeroed one-element bool tensor (dedup_launch's), is the sums' NaN/inf
  // flag of a backward that launches them itself (else the forward makes one). The mutable
  // arguments are those the backward writes: values (the update), steps, workspace (resized and
  // written) and nonfinite (the sums' flag on CUDA); the forward writes none of them.
  m.def(
      "summed_update(Tensor trigger, Tensor(a) out, Tensor order, Tensor starts, Tensor? plan, "
      "Tensor? rows, Tensor? scale, Tensor slots, int[] table_sizes, Tensor(b!)[] values, "
      "int[] dims, Tensor(c!) steps, str optimizer, float[] hyper_parameters, float? clip, "
      "bool check, int dim, Tensor(d!)? workspace=None, Tensor(e!)? nonfinite=None) -> "
      "Tensor(a)");
}

// `import demb_kernels._C` loads the library (and runs the registrations above).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                               nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
