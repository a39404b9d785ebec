/* The C API from C: every call's success path on the tiny-v4.1 preset, and every error path
 * (bad handle, bad shape, bad dtype, bad device, bad layout, pool exhausted, I/O, invalid
 * argument, unsupported) with its status and message. Exits 1 on the first failed check. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4/dsv4.h"

static int checks = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    ++checks;                                                                    \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

/* A call that must succeed. */
#define OK(call)                                                                          \
  do {                                                                                    \
    dsv4_status st_ = (call);                                                             \
    ++checks;                                                                             \
    if (st_ != DSV4_OK) {                                                                 \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,                 \
              dsv4_status_name(st_), dsv4_last_error());                                  \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* A call that must fail with `status` and a message containing `text`. */
#define FAILS(call, status, text)                                                         \
  do {                                                                                    \
    dsv4_status st_ = (call);                                                             \
    ++checks;                                                                             \
    if (st_ != (status) || strstr(dsv4_last_error(), (text)) == NULL ||                   \
        strncmp(dsv4_last_error(), "dsv4: ", 6) != 0) {                                   \
      fprintf(stderr, "%s:%d: %s -> %s (expected %s), message '%s' (expected '%s')\n",    \
              __FILE__, __LINE__, #call, dsv4_status_name(st_), dsv4_status_name(status), \
              dsv4_last_error(), (text));                                                 \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* A compact CPU DLTensor over `data`. */
typedef struct {
  DLTensor t;
  int64_t shape[4];
} Tensor;

static Tensor tensor(void* data, uint8_t code, uint8_t bits, int ndim, int64_t d0, int64_t d1, int64_t d2) {
  Tensor x;
  memset(&x, 0, sizeof x);
  x.shape[0] = d0;
  x.shape[1] = d1;
  x.shape[2] = d2;
  x.t.data = data;
  x.t.device.device_type = kDLCPU;
  x.t.ndim = ndim;
  x.t.dtype.code = code;
  x.t.dtype.bits = bits;
  x.t.dtype.lanes = 1;
  x.t.shape = x.shape;
  return x;
}
/* The DLTensor of x, its shape pointer aimed at x's own array (x may have been copied). */
static const DLTensor* dl(Tensor* x) {
  x->t.shape = x->shape;
  return &x->t;
}
#define F32(data, ndim, a, b, c) tensor((data), kDLFloat, 32, (ndim), (a), (b), (c))
#define I32(data, ndim, a, b, c) tensor((data), kDLInt, 32, (ndim), (a), (b), (c))
#define I64(data, ndim, a, b, c) tensor((data), kDLInt, 64, (ndim), (a), (b), (c))
#define U8(data, ndim, a, b, c) tensor((data), kDLUInt, 8, (ndim), (a), (b), (c))

static float frand(unsigned* state) {
  *state = *state * 1664525u + 1013904223u;
  return ((float)(*state >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

static void test_config(void) {
  dsv4_config* config = NULL;
  int64_t v = 0;
  char buf[256];
  size_t needed = 0;
  dsv4_layer_plan plan;

  CHECK(strcmp(dsv4_version(), "") != 0);
  CHECK(strcmp(dsv4_status_name(DSV4_ERROR_POOL_EXHAUSTED), "DSV4_ERROR_POOL_EXHAUSTED") == 0);
  OK(dsv4_preset_names(buf, sizeof buf, &needed));
  CHECK(strstr(buf, "tiny-v4.1") != NULL && needed == strlen(buf) + 1);
  FAILS(dsv4_preset_names(buf, 3, &needed), DSV4_ERROR_INVALID_ARGUMENT, "buffer of 3 bytes");

  OK(dsv4_config_from_preset("tiny-v4.1", &config));
  OK(dsv4_config_name(config, buf, sizeof buf, NULL));
  CHECK(strcmp(buf, "tiny-v4.1") == 0);
  OK(dsv4_config_get_int(config, "family", &v));
  CHECK(v == 1);
  OK(dsv4_config_get_int(config, "head_dim", &v));
  CHECK(v == 512);
  OK(dsv4_config_get_int(config, "total_layers", &v));
  OK(dsv4_config_layer_plan(config, 0, &plan));
  CHECK(plan.layer == 0);
  OK(dsv4_config_kv_bytes(config, "v4.1-native", "reference", 4096, &v));
  CHECK(v > 0);

  FAILS(dsv4_config_get_int(config, "no_such_field", &v), DSV4_ERROR_INVALID_ARGUMENT, "unknown field 'no_such_field'");
  FAILS(dsv4_config_layer_plan(config, 999, &plan), DSV4_ERROR_INVALID_ARGUMENT, "layer 999");
  FAILS(dsv4_config_kv_bytes(config, "no-such-set", NULL, 16, &v), DSV4_ERROR_INVALID_ARGUMENT, "no-such-set");
  FAILS(dsv4_config_get_int(config, "head_dim", NULL), DSV4_ERROR_INVALID_ARGUMENT, "value is NULL");
  FAILS(dsv4_config_from_preset("no-such-preset", &config), DSV4_ERROR_INVALID_ARGUMENT, "no-such-preset");
  FAILS(dsv4_config_from_file("/nonexistent/config.json", &config), DSV4_ERROR_IO, "/nonexistent/config.json");
  FAILS(dsv4_config_from_json("{not json", &config), DSV4_ERROR_IO, "json");

  /* Bad handles: NULL, destroyed, of another kind. */
  FAILS(dsv4_config_get_int(NULL, "head_dim", &v), DSV4_ERROR_BAD_HANDLE, "config is NULL");
  OK(dsv4_config_destroy(config));
  FAILS(dsv4_config_get_int(config, "head_dim", &v), DSV4_ERROR_BAD_HANDLE, "not a live dsv4_config");
  FAILS(dsv4_config_destroy(config), DSV4_ERROR_BAD_HANDLE, "not a live dsv4_config");
}

static void test_engine(void) {
  dsv4_config* config = NULL;
  dsv4_weights* weights = NULL;
  dsv4_engine* engine = NULL;
  dsv4_engine_options options;
  int64_t hidden = 0, layers = 0, topk = 0, a = -1, b = -1, c = -1, length = 0, rows = 0, cols = 0, bytes = 0;
  dsv4_engine_memory memory;
  void* stream = (void*)1;
  unsigned seed = 7;

  OK(dsv4_config_from_preset("tiny-v4.1", &config));
  OK(dsv4_config_get_int(config, "hidden_size", &hidden));
  OK(dsv4_config_get_int(config, "total_layers", &layers));
  OK(dsv4_config_get_int(config, "index_topk", &topk));
  OK(dsv4_weights_random(config, 1, 0, &weights));
  FAILS(dsv4_weights_load(config, "/nonexistent.safetensors", &weights), DSV4_ERROR_IO, "does not exist");

  dsv4_engine_options_init(&options);
  CHECK(strcmp(options.backend, "cpu") == 0 && options.max_sequences > 0);
  options.max_sequences = 2;
  options.max_context = 256;
  options.max_tokens_per_step = 64;
  options.num_threads = 1;

  FAILS(dsv4_engine_create(config, (const dsv4_weights*)config, &options, &engine), DSV4_ERROR_BAD_HANDLE,
        "is a dsv4_config, expected a dsv4_weights");
  options.precision = "fp16";
  FAILS(dsv4_engine_create(config, weights, &options, &engine), DSV4_ERROR_INVALID_ARGUMENT, "fp16");
  options.precision = "reference";
  options.cache_storage = "disk";
  FAILS(dsv4_engine_create(config, weights, &options, &engine), DSV4_ERROR_INVALID_ARGUMENT, "'disk'");
  options.cache_storage = "paged";
  if (!dsv4_has_cuda()) {
    options.backend = "cuda";
    FAILS(dsv4_engine_create(config, weights, &options, &engine), DSV4_ERROR_UNSUPPORTED, "without CUDA");
    options.backend = "cpu";
  }
  OK(dsv4_engine_create(config, weights, &options, &engine));
  /* The engine keeps what it needs: config and weights may go now. */
  OK(dsv4_weights_destroy(weights));
  OK(dsv4_config_destroy(config));

  OK(dsv4_engine_memory_usage(engine, &memory));
  CHECK(memory.weights > 0 && memory.caches > 0);
  OK(dsv4_engine_cuda_stream(engine, &stream));
  CHECK(stream == NULL);

  OK(dsv4_engine_add_sequence(engine, &a));
  {
    const int64_t n = 5;
    float* in = malloc(sizeof(float) * n * hidden);
    float* out = malloc(sizeof(float) * n * hidden);
    double* dummy = malloc(sizeof(double) * n * hidden);
    int64_t strides[2] = {1, n};
    int64_t seqs[1], toks[1];
    int32_t picks[64 * 8];
    Tensor tin = F32(in, 2, n, hidden, 0), tout = F32(out, 2, n, hidden, 0);
    Tensor bad_shape = F32(in, 2, n - 1, hidden, 0), bad_dtype = tensor(dummy, kDLFloat, 64, 2, n, hidden, 0);
    Tensor bad_device = F32(in, 2, n, hidden, 0), bad_layout = F32(in, 2, n, hidden, 0);
    int l;
    bad_device.t.device.device_type = kDLCUDA;
    bad_layout.t.strides = strides;
    for (int64_t i = 0; i < n * hidden; ++i) in[i] = frand(&seed);

    FAILS(dsv4_engine_run_layer(engine, 0, dl(&tin), dl(&tout)), DSV4_ERROR_INVALID_ARGUMENT, "no step is open");
    seqs[0] = a;
    toks[0] = 0;
    FAILS(dsv4_engine_begin_step(engine, seqs, toks, 1), DSV4_ERROR_INVALID_ARGUMENT, "num_tokens");
    toks[0] = n;
    OK(dsv4_engine_begin_step(engine, seqs, toks, 1));
    FAILS(dsv4_engine_rollback_sequence(engine, a, 0), DSV4_ERROR_INVALID_ARGUMENT, "a step is open");
    FAILS(dsv4_engine_run_layer(engine, 0, dl(&bad_shape), dl(&tout)), DSV4_ERROR_BAD_SHAPE,
          "engine_run_layer: hidden_in has shape [4, ");
    FAILS(dsv4_engine_run_layer(engine, 0, dl(&tin), dl(&bad_dtype)), DSV4_ERROR_BAD_DTYPE,
          "attn_out has dtype float64, expected float32");
    FAILS(dsv4_engine_run_layer(engine, 0, dl(&bad_device), dl(&tout)), DSV4_ERROR_BAD_DEVICE, "expected the CPU");
    FAILS(dsv4_engine_run_layer(engine, 0, dl(&bad_layout), dl(&tout)), DSV4_ERROR_BAD_LAYOUT, "not compact row-major");
    FAILS(dsv4_engine_run_layer(engine, 0, NULL, dl(&tout)), DSV4_ERROR_INVALID_ARGUMENT, "hidden_in is NULL");
    FAILS(dsv4_engine_run_layer(engine, (int32_t)layers, dl(&tin), dl(&tout)), DSV4_ERROR_INVALID_ARGUMENT, "layer");
    FAILS(dsv4_engine_end_step(engine), DSV4_ERROR_INVALID_ARGUMENT, "has not run");
    for (l = 0; l < layers; ++l) {
      dsv4_layer_plan plan;
      dsv4_config* own = NULL;
      OK(dsv4_engine_config(engine, &own));
      OK(dsv4_config_layer_plan(own, l, &plan));
      OK(dsv4_config_destroy(own));
      if (plan.is_mtp) continue;
      OK(dsv4_engine_run_layer(engine, l, dl(&tin), dl(&tout)));
      if (plan.owns_indexer) {
        OK(dsv4_engine_layer_picks_shape(engine, l, &rows, &cols));
        CHECK(rows == n && cols == topk && rows * cols <= 64 * 8);
        {
          Tensor tp = I32(picks, 2, rows, cols, 0), tp_bad = I32(picks, 2, rows, cols + 1, 0);
          OK(dsv4_engine_layer_picks(engine, l, dl(&tp)));
          FAILS(dsv4_engine_layer_picks(engine, l, dl(&tp_bad)), DSV4_ERROR_BAD_SHAPE, "picks has shape");
        }
        CHECK(picks[0] == 0 || picks[0] == -1);
      }
    }
    for (int64_t i = 0; i < n * hidden; ++i) CHECK(isfinite(out[i]));
    OK(dsv4_engine_end_step(engine));
    OK(dsv4_engine_sequence_length(engine, a, &length));
    CHECK(length == n);
    /* max_rollback is 0: nothing can be taken back. */
    FAILS(dsv4_engine_rollback_sequence(engine, a, n - 1), DSV4_ERROR_INVALID_ARGUMENT, "expected a length in [5, 5]");
    OK(dsv4_engine_rollback_sequence(engine, a, n));
    OK(dsv4_engine_sequence_cache_bytes(engine, a, &bytes));
    CHECK(bytes > 0);
    free(in);
    free(out);
    free(dummy);
  }

  /* max_sequences = 2: the third live sequence is refused with the status a scheduler acts on. */
  OK(dsv4_engine_fork_sequence(engine, a, &b));
  OK(dsv4_engine_sequence_length(engine, b, &length));
  CHECK(length == 5);
  FAILS(dsv4_engine_add_sequence(engine, &c), DSV4_ERROR_POOL_EXHAUSTED, "sequences are live");
  FAILS(dsv4_engine_fork_sequence(engine, a, &c), DSV4_ERROR_POOL_EXHAUSTED, "sequences are live");
  OK(dsv4_engine_release_sequence(engine, b));
  OK(dsv4_engine_add_sequence(engine, &c));
  FAILS(dsv4_engine_release_sequence(engine, b), DSV4_ERROR_INVALID_ARGUMENT, "does not exist");
  FAILS(dsv4_engine_sequence_length(engine, 12345, &length), DSV4_ERROR_INVALID_ARGUMENT, "12345");

  OK(dsv4_engine_destroy(engine));
  FAILS(dsv4_engine_add_sequence(engine, &a), DSV4_ERROR_BAD_HANDLE, "not a live dsv4_engine");
  FAILS(dsv4_engine_destroy(NULL), DSV4_ERROR_BAD_HANDLE, "engine is NULL");
}

static void test_kv_codecs(void) {
  const char* formats[] = {"bf16", "fp8_per_tensor", "v41_fp8", "v41_fp4", "fp8_ds_mla", "index_mxfp4", "index_fp8"};
  const char* placements[] = {"segregated", "interleaved"};
  unsigned seed = 3;
  size_t f, p;
  for (f = 0; f < sizeof formats / sizeof *formats; ++f)
    for (p = 0; p < 2; ++p) {
      const int64_t dims = strncmp(formats[f], "index", 5) == 0 ? 128 : 512, n = 5, num_pages = 2;
      dsv4_page_geometry g;
      float x[5 * 512], y[5 * 512];
      int64_t slots[5] = {3, 0, -1, 7, 2};
      uint8_t* pages;
      OK(dsv4_kv_page_geometry(formats[f], dims, 4, placements[p], &g));
      CHECK(g.rows_per_page == 4 && g.row_bytes == g.data_bytes + g.scale_bytes && g.page_stride >= 4 * g.row_bytes);
      pages = calloc((size_t)(num_pages * g.page_stride), 1);
      for (int64_t i = 0; i < n * dims; ++i) x[i] = frand(&seed);
      {
        Tensor tx = F32(x, 2, n, dims, 0), ty = F32(y, 2, n, dims, 0), ts = I64(slots, 1, n, 0, 0);
        Tensor tp = U8(pages, 2, num_pages, g.page_stride, 0);
        Tensor tp_bad = U8(pages, 2, num_pages, g.page_stride - 1, 0);
        Tensor ts_bad = I32(slots, 1, n, 0, 0);
        OK(dsv4_kv_encode(formats[f], 4, placements[p], dl(&tx), dl(&ts), dl(&tp), 1.0f, NULL, NULL));
        OK(dsv4_kv_decode(formats[f], 4, placements[p], dl(&tp), dl(&ts), dl(&ty), 1.0f, NULL));
        for (int64_t r = 0; r < n; ++r)
          for (int64_t d = 0; d < dims; ++d) {
            const float want = x[r * dims + d], got = y[r * dims + d];
            if (slots[r] < 0) CHECK(got == 0.0f);
            else CHECK(fabsf(got - want) <= 0.5f * fabsf(want) + 0.08f); /* fp4: coarse */
          }
        FAILS(dsv4_kv_encode(formats[f], 4, placements[p], dl(&tx), dl(&ts), dl(&tp_bad), 1.0f, NULL, NULL), DSV4_ERROR_BAD_SHAPE,
              "kv_encode: pages has shape");
        FAILS(dsv4_kv_encode(formats[f], 4, placements[p], dl(&tx), dl(&ts_bad), dl(&tp), 1.0f, NULL, NULL), DSV4_ERROR_BAD_DTYPE,
              "slots has dtype int32, expected int64");
        slots[0] = 8;
        FAILS(dsv4_kv_decode(formats[f], 4, placements[p], dl(&tp), dl(&ts), dl(&ty), 1.0f, NULL), DSV4_ERROR_INVALID_ARGUMENT,
              "slots[0] = 8, expected < 8");
      }
      free(pages);
    }
  FAILS(dsv4_kv_page_geometry("fp5", 512, 4, NULL, NULL), DSV4_ERROR_INVALID_ARGUMENT, "geometry is NULL");
  {
    dsv4_page_geometry g;
    FAILS(dsv4_kv_page_geometry("fp5", 512, 4, NULL, &g), DSV4_ERROR_INVALID_ARGUMENT, "fp5");
    FAILS(dsv4_kv_page_geometry("v41_fp8", 500, 4, NULL, &g), DSV4_ERROR_INVALID_ARGUMENT, "500");
    FAILS(dsv4_kv_page_geometry("v41_fp8", 512, 4, "sideways", &g), DSV4_ERROR_INVALID_ARGUMENT, "sideways");
  }
}

static void test_ops(void) {
  enum { T = 2, H = 3, D = 8, N = 6, K = 4 };
  float q[T * H * D], kv[N * D], out[T * H * D], lse[T * H], sink[H] = {0.1f, -0.2f, 0.3f};
  int32_t idx[T * K] = {0, 2, -1, 5, 1, 1, 3, -1};
  int32_t lengths[T] = {4, 2};
  unsigned seed = 11;
  int64_t i;
  for (i = 0; i < T * H * D; ++i) q[i] = frand(&seed);
  for (i = 0; i < N * D; ++i) kv[i] = frand(&seed);
  {
    Tensor tq = F32(q, 3, T, H, D), tkv = F32(kv, 2, N, D, 0), ti = I32(idx, 2, T, K, 0), tl = I32(lengths, 1, T, 0, 0);
    Tensor ts = F32(sink, 1, H, 0, 0), to = F32(out, 3, T, H, D), tlse = F32(lse, 2, T, H, 0);
    Tensor tkv_bad = F32(kv, 2, N, D - 1, 0);
    OK(dsv4_sparse_attention(dl(&tq), dl(&tkv), dl(&ti), dl(&tl), dl(&ts), 0.35f, 0, dl(&to), dl(&tlse), NULL));
    /* Token 0, head 0 by hand. */
    {
      double m = -INFINITY, s = 0, o0 = 0, l[3];
      const int rows[3] = {0, 2, 5};
      int r;
      for (r = 0; r < 3; ++r) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += (double)q[d] * kv[rows[r] * D + d];
        l[r] = 0.35 * dot;
        if (l[r] > m) m = l[r];
      }
      for (r = 0; r < 3; ++r) {
        s += exp(l[r] - m);
        o0 += exp(l[r] - m) * kv[rows[r] * D];
      }
      CHECK(fabs(out[0] - o0 / (s + exp(sink[0] - m))) < 1e-5);
      CHECK(fabs(lse[0] - (m + log(s))) < 1e-5);
    }
    FAILS(dsv4_sparse_attention(dl(&tq), dl(&tkv_bad), dl(&ti), NULL, NULL, 1.0f, 0, dl(&to), NULL, NULL), DSV4_ERROR_BAD_SHAPE,
          "kv has shape [6, 7], expected [6, 8]");
    idx[0] = 6;
    FAILS(dsv4_sparse_attention(dl(&tq), dl(&tkv), dl(&ti), NULL, NULL, 1.0f, 0, dl(&to), NULL, NULL), DSV4_ERROR_INVALID_ARGUMENT,
          "indices[0, 0] = 6");
    idx[0] = 0;
  }
  {
    /* The same attention over pages: bf16 rows of 4 a page, read through flat slots, equals the
     * flat call on the bf16-rounded rows; bad device and out-of-range slots are named. */
    enum { RPP = 4, PAGES = 2 };
    dsv4_page_geometry g;
    float rounded[N * D], flat[T * H * D], paged[T * H * D], flat_lse[T * H], paged_lse[T * H];
    int64_t slots[N] = {0, 1, 2, 3, 4, 5};
    uint8_t* pages;
    OK(dsv4_kv_page_geometry("bf16", D, RPP, NULL, &g));
    pages = calloc((size_t)(PAGES * g.page_stride), 1);
    {
      Tensor tq = F32(q, 3, T, H, D), tkv = F32(kv, 2, N, D, 0), tr = F32(rounded, 2, N, D, 0);
      Tensor tslots = I64(slots, 1, N, 0, 0), tp = U8(pages, 2, PAGES, g.page_stride, 0);
      Tensor ti = I32(idx, 2, T, K, 0), tl = I32(lengths, 1, T, 0, 0), ts = F32(sink, 1, H, 0, 0);
      Tensor tf = F32(flat, 3, T, H, D), tpo = F32(paged, 3, T, H, D);
      Tensor tfl = F32(flat_lse, 2, T, H, 0), tpl = F32(paged_lse, 2, T, H, 0), tp_gpu = tp;
      OK(dsv4_kv_encode("bf16", RPP, NULL, dl(&tkv), dl(&tslots), dl(&tp), 1.0f, NULL, NULL));
      OK(dsv4_kv_decode("bf16", RPP, NULL, dl(&tp), dl(&tslots), dl(&tr), 1.0f, NULL));
      OK(dsv4_sparse_attention(dl(&tq), dl(&tr), dl(&ti), dl(&tl), dl(&ts), 0.35f, 1, dl(&tf), dl(&tfl), NULL));
      OK(dsv4_paged_sparse_attention(dl(&tq), "bf16", RPP, NULL, dl(&tp), 1.0f, dl(&ti), dl(&tl), dl(&ts), 0.35f, 1,
                                     dl(&tpo), dl(&tpl), NULL));
      CHECK(memcmp(flat, paged, sizeof flat) == 0 && memcmp(flat_lse, paged_lse, sizeof flat_lse) == 0);
      tp_gpu.t.device.device_type = kDLCUDA;
      FAILS(dsv4_paged_sparse_attention(dl(&tq), "bf16", RPP, NULL, dl(&tp_gpu), 1.0f, dl(&ti), NULL, NULL, 1.0f, 0,
                                        dl(&tpo), NULL, NULL),
            DSV4_ERROR_BAD_DEVICE, "pages is on device type 2, expected the CPU");
      idx[1] = PAGES * RPP;
      FAILS(dsv4_paged_sparse_attention(dl(&tq), "bf16", RPP, NULL, dl(&tp), 1.0f, dl(&ti), NULL, NULL, 1.0f, 0,
                                        dl(&tpo), NULL, NULL),
            DSV4_ERROR_INVALID_ARGUMENT, "indices[0, 1] = 8, expected < 8");
      idx[1] = 2;
    }
    free(pages);
  }
  {
    float w[T * H], scores[T * N];
    /* n_visible = (position + 1) / ratio: 6 and 3 entries with ratio 2. */
    int32_t positions[T] = {12, 6};
    int32_t picks[T * 2];
    Tensor tq = F32(q, 3, T, H, D), tw = F32(w, 2, T, H, 0), tk = F32(kv, 2, N, D, 0), tv = I32(positions, 1, T, 0, 0);
    Tensor ts = F32(scores, 2, T, N, 0), tp = I32(picks, 2, T, 2, 0), tv_bad = I32(positions, 1, T / 2, 0, 0);
    for (i = 0; i < T * H; ++i) w[i] = 1.0f;
    OK(dsv4_index_scores(dl(&tq), dl(&tw), dl(&tk), dl(&tv), 2, 0, dl(&ts), NULL));
    CHECK(isinf(scores[N + 3]) && scores[N + 3] < 0 && !isinf(scores[N + 2]) && !isinf(scores[N - 1]));
    OK(dsv4_topk(dl(&ts), dl(&tv), 2, dl(&tp), NULL));
    CHECK(picks[0] < picks[1] && picks[2] < picks[3] && picks[3] < 3);
    FAILS(dsv4_topk(dl(&ts), dl(&tv_bad), 2, dl(&tp), NULL), DSV4_ERROR_BAD_SHAPE,
          "token_position has shape [1], expected [2]");
    FAILS(dsv4_index_scores(dl(&tq), dl(&tw), dl(&tk), dl(&tv), 0, 0, dl(&ts), NULL), DSV4_ERROR_INVALID_ARGUMENT,
          "compress_ratio is 0, expected >= 1");
  }
  {
    enum { E = 2, S = 4, C = 3 };
    float k[E * S * C], sc[E * S * C], pooled[E * C];
    Tensor tk = F32(k, 3, E, S, C), ts = F32(sc, 3, E, S, C), tp = F32(pooled, 2, E, C, 0);
    Tensor tp_bad = F32(pooled, 3, E, C, 1);
    for (i = 0; i < E * S * C; ++i) {
      k[i] = 2.0f;
      sc[i] = frand(&seed);
    }
    OK(dsv4_compressor_pool(dl(&tk), dl(&ts), NULL, dl(&tp)));
    for (i = 0; i < E * C; ++i) CHECK(fabsf(pooled[i] - 2.0f) < 1e-5f);
    FAILS(dsv4_compressor_pool(dl(&tk), dl(&ts), NULL, dl(&tp_bad)), DSV4_ERROR_BAD_SHAPE, "pooled has shape [2, 3, 1]");
  }
}

/* The message is per thread: another thread's failure leaves this thread's message alone. */
static void* fail_in_thread(void* arg) {
  dsv4_config* config = NULL;
  (void)arg;
  if (dsv4_config_from_preset("thread-preset", &config) != DSV4_ERROR_INVALID_ARGUMENT) return (void*)1;
  return strstr(dsv4_last_error(), "thread-preset") ? NULL : (void*)1;
}

static void test_thread_messages(void) {
  pthread_t thread;
  void* result = (void*)1;
  dsv4_config* config = NULL;
  FAILS(dsv4_config_from_preset("main-preset", &config), DSV4_ERROR_INVALID_ARGUMENT, "main-preset");
  CHECK(pthread_create(&thread, NULL, fail_in_thread, NULL) == 0);
  CHECK(pthread_join(thread, &result) == 0);
  CHECK(result == NULL);
  CHECK(strstr(dsv4_last_error(), "main-preset") != NULL);
}

int main(void) {
  test_config();
  test_engine();
  test_kv_codecs();
  test_ops();
  test_thread_messages();
  printf("capi_test: %d checks passed\n", checks);
  return 0;
}
