// tessera-bench: times every registered case (CUDA graph and plain stream launches), relates it to the measured
// copy and read bandwidths, optionally checks it against the CPU reference, and prints a table (and optionally JSON).
//
// Exit code: 0 all good, 1 a check failed or a case threw, 2 bad usage or no usable device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "timing.h"

namespace tessera::bench {
namespace {

struct Options {
  std::vector<std::string> ops;    // substrings of op names (any matches); empty = all
  std::vector<std::string> cases;  // substrings of case names (any matches); empty = all
  bool check = false;
  bool list = false;
  bool quick = false;
  int reps = -1;
  int warmup = -1;
  int device = 0;
  std::string json;
};

const char* kUsage =
    "usage: tessera-bench [options]\n"
    "  --op LIST       only these ops: comma-separated op names (exact) or substrings of them\n"
    "                  (fused_gate, permute, unpermute_reduce, gate, grouped_gemm_fp8, cublaslt_fp8_loop, ...)\n"
    "  --case LIST     only cases whose name contains one of the comma-separated substrings (e.g. dsv3/T4096)\n"
    "  --check         verify each case against the CPU reference before timing (FAIL -> exit code 1)\n"
    "  --json PATH     write all rows as JSON\n"
    "  --reps N        timed samples per mode (stream: calls; graph: replays); default 50, --quick 10\n"
    "  --warmup N      untimed calls before timing; default 10, --quick 3\n"
    "  --quick         fewer repetitions\n"
    "  --device N      CUDA device ordinal (default 0)\n"
    "  --list          list the cases and exit\n";

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

bool matches(const std::string& s, const std::vector<std::string>& subs) {
  if (subs.empty()) return true;
  return std::any_of(subs.begin(), subs.end(), [&](const std::string& p) { return s.find(p) != std::string::npos; });
}

// Returns false (after printing why) on bad usage.
bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&](std::string& out) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "tessera-bench: %s needs a value\n", a.c_str());
        return false;
      }
      out = argv[++i];
      return true;
    };
    const auto int_value = [&](int& out, int lo) {
      std::string v;
      if (!value(v)) return false;
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < lo || n > 1000000) {
        std::fprintf(stderr, "tessera-bench: %s expects an integer >= %d, got '%s'\n", a.c_str(), lo, v.c_str());
        return false;
      }
      out = static_cast<int>(n);
      return true;
    };
    std::string v;
    if (a == "--op") {
      if (!value(v)) return false;
      o.ops = split_list(v);
    } else if (a == "--case") {
      if (!value(v)) return false;
      o.cases = split_list(v);
    } else if (a == "--json") {
      if (!value(o.json)) return false;
    } else if (a == "--reps") {
      if (!int_value(o.reps, 1)) return false;
    } else if (a == "--warmup") {
      if (!int_value(o.warmup, 0)) return false;
    } else if (a == "--device") {
      if (!int_value(o.device, 0)) return false;
    } else if (a == "--check") {
      o.check = true;
    } else if (a == "--list") {
      o.list = true;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      std::fprintf(stderr, "tessera-bench: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return false;
    }
  }
  if (o.reps < 0) o.reps = o.quick ? 10 : 50;
  if (o.warmup < 0) o.warmup = o.quick ? 3 : 10;
  return true;
}

struct Row {
  const CaseSpec* spec = nullptr;
  int num_sets = 0;
  ModeTiming graph, stream;
  std::string check = "-";  // PASS | FAIL | - (not run)
  std::string check_message;
  double check_error = NAN;
  std::string error;        // setup threw, or a timing mode threw
  std::string unsupported;  // a peer that does not support the case (not a failure)

  bool failed() const { return check == "FAIL" || !error.empty(); }
  // The headline time: graph mode when it worked (no launch gaps), else stream mode.
  const ModeTiming* headline() const { return graph.ok ? &graph : stream.ok ? &stream : nullptr; }
};

struct Device {
  int ordinal = 0;
  std::string name;
  DeviceContext ctx;
  StreamCeiling copy;  // read + write
  StreamCeiling read;  // read only
};

double gbps(const Row& r) {
  const ModeTiming* t = r.headline();
  return t ? r.spec->bytes / (t->median_us * 1e-6) / 1e9 : NAN;
}
double tflops(const Row& r) {
  const ModeTiming* t = r.headline();
  return t && r.spec->flops > 0 ? r.spec->flops / (t->median_us * 1e-6) / 1e12 : NAN;
}

// Peer rows compared with row r: rows whose spec lists r's op in peer_of and has r's case name.
std::vector<const Row*> peers_of(const Row& r, const std::vector<Row>& rows) {
  std::vector<const Row*> out;
  for (const Row& p : rows)
    if (&p != &r && p.spec->name == r.spec->name &&
        std::find(p.spec->peer_of.begin(), p.spec->peer_of.end(), r.spec->op) != p.spec->peer_of.end())
      out.push_back(&p);
  return out;
}
// tessera µs / peer µs in the same timing mode (graph if both have it, else stream); NaN if none is shared.
double peer_ratio(const Row& r, const Row& p) {
  if (r.graph.ok && p.graph.ok) return r.graph.median_us / p.graph.median_us;
  if (r.stream.ok && p.stream.ok) return r.stream.median_us / p.stream.median_us;
  return NAN;
}
bool any_peers(const std::vector<Row>& rows) {
  return std::any_of(rows.begin(), rows.end(), [](const Row& r) { return !r.spec->peer_of.empty(); });
}

std::string fmt(const char* f, double v) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

void note_error(std::string& dst, const std::string& what) { dst += (dst.empty() ? "" : "; ") + what; }

// Display width of UTF-8 text (counts code points; the table has no wide characters).
size_t width_of(const std::string& s) {
  return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

void print_table(const std::vector<Row>& rows, const Device& dev) {
  // The peer column appears only when a peer row was run, so tables without peers keep their shape.
  const bool peer_column = any_peers(rows);
  std::vector<std::string> head = {"op", "case", "graph µs", "stream µs", "GB/s", "% copy BW", "% read BW", "TFLOP/s",
                                   "check"};
  if (peer_column) head.insert(head.end() - 1, "tessera/peer");
  std::vector<std::vector<std::string>> cells;
  for (const Row& r : rows) {
    const double bw = gbps(r);
    cells.push_back({r.spec->op, r.spec->name, r.graph.ok ? fmt("%.2f", r.graph.median_us) : "-",
                     r.stream.ok ? fmt("%.2f", r.stream.median_us) : "-", fmt("%.1f", bw),
                     fmt("%.1f", 100.0 * bw * 1e9 / dev.copy.bytes_per_s),
                     fmt("%.1f", 100.0 * bw * 1e9 / dev.read.bytes_per_s), fmt("%.3f", tflops(r)),
                     !r.unsupported.empty() ? "n/a" : r.error.empty() ? r.check : (r.check == "FAIL" ? "FAIL" : "ERROR")});
    if (peer_column) {
      std::string ratios;
      for (const Row* p : peers_of(r, rows)) ratios += (ratios.empty() ? "" : ", ") + fmt("%.2f", peer_ratio(r, *p));
      cells.back().insert(cells.back().end() - 1, ratios.empty() ? "-" : ratios);
    }
  }
  std::vector<size_t> w(head.size());
  for (size_t c = 0; c < head.size(); ++c) {
    w[c] = width_of(head[c]);
    for (const auto& row : cells) w[c] = std::max(w[c], width_of(row[c]));
  }
  const auto line = [&](const std::vector<std::string>& v) {
    std::string out;
    for (size_t c = 0; c < v.size(); ++c) {
      const std::string pad(w[c] - width_of(v[c]), ' ');
      out += c < 2 ? v[c] + pad : pad + v[c];  // text left, numbers right
      out += c + 1 < v.size() ? " | " : "\n";
    }
    std::fputs(out.c_str(), stdout);
  };
  line(head);
  std::string rule;
  for (size_t c = 0; c < w.size(); ++c) rule += std::string(w[c], '-') + (c + 1 < w.size() ? "-|-" : "\n");
  std::fputs(rule.c_str(), stdout);
  for (const auto& row : cells) line(row);
  std::printf("(GB/s, %% copy BW, %% read BW and TFLOP/s from the graph time, or the stream time where graph mode "
              "failed)\n");
  if (peer_column) {
    std::vector<std::string> peer_ops;
    for (const Row& r : rows)
      if (!r.spec->peer_of.empty() && std::find(peer_ops.begin(), peer_ops.end(), r.spec->op) == peer_ops.end())
        peer_ops.push_back(r.spec->op);
    std::string list;
    for (const std::string& op : peer_ops) list += (list.empty() ? "" : ", ") + op;
    std::printf("(tessera/peer: tessera µs / µs of the peer row with the same case name (%s), graph mode where both "
                "have it; < 1: tessera is faster)\n",
                list.c_str());
  }
}

void print_details(const std::vector<Row>& rows, bool checked) {
  bool header = false;
  for (const Row& r : rows) {
    if (r.error.empty() && r.unsupported.empty() && !(checked && !r.check_message.empty())) continue;
    if (!header) std::printf("\nnotes:\n");
    header = true;
    if (!r.check_message.empty())
      std::printf("  %s %s %s: %s\n", r.check.c_str(), r.spec->op.c_str(), r.spec->name.c_str(), r.check_message.c_str());
    if (!r.error.empty()) std::printf("  ERROR %s %s: %s\n", r.spec->op.c_str(), r.spec->name.c_str(), r.error.c_str());
    if (!r.unsupported.empty())
      std::printf("  n/a %s %s: %s\n", r.spec->op.c_str(), r.spec->name.c_str(), r.unsupported.c_str());
  }
}

// ---- JSON ----------------------------------------------------------------------------------------------------
std::string jstr(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}
std::string jnum(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.10g", v);
  return buf;
}
std::string jtiming(const ModeTiming& t) {
  if (!t.ok) return "null";
  return "{\"median_us\": " + jnum(t.median_us) + ", \"min_us\": " + jnum(t.min_us) + ", \"max_us\": " +
         jnum(t.max_us) + ", \"samples\": " + std::to_string(t.samples) +
         ", \"calls_per_sample\": " + std::to_string(t.calls_per_sample) + "}";
}

std::string jlist(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + jstr(v[i]);
  return out + "]";
}
// [{"op": peer op, "us": peer headline µs, "tessera_over_peer": ratio}, ...] for the peer rows of r.
std::string jpeers(const Row& r, const std::vector<Row>& rows) {
  std::string out = "[";
  bool first = true;
  for (const Row* p : peers_of(r, rows)) {
    const ModeTiming* t = p->headline();
    out += std::string(first ? "" : ", ") + "{\"op\": " + jstr(p->spec->op) + ", \"us\": " +
           jnum(t ? t->median_us : NAN) + ", \"tessera_over_peer\": " + jnum(peer_ratio(r, *p)) + "}";
    first = false;
  }
  return out + "]";
}

void write_json(const std::string& path, const std::vector<Row>& rows, const Device& dev, const Options& o) {
  std::ofstream f(path);
  if (!f) throw Error("tessera-bench: cannot open '" + path + "' for writing");
  f << "{\n  \"tool\": \"tessera-bench\",\n";
  f << "  \"device\": {\"name\": " << jstr(dev.name) << ", \"ordinal\": " << dev.ordinal
    << ", \"num_sms\": " << dev.ctx.num_sms << ", \"l2_bytes\": " << dev.ctx.l2_bytes
    << ", \"copy_bw_gbps\": " << jnum(dev.copy.bytes_per_s / 1e9) << ", \"copy_bytes\": " << jnum(dev.copy.buffer_bytes)
    << ", \"read_bw_gbps\": " << jnum(dev.read.bytes_per_s / 1e9) << "},\n";
  f << "  \"settings\": {\"reps\": " << o.reps << ", \"warmup\": " << o.warmup
    << ", \"quick\": " << (o.quick ? "true" : "false") << ", \"check\": " << (o.check ? "true" : "false") << "},\n";
  f << "  \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const ModeTiming* h = r.headline();
    const double bw = gbps(r);
    f << (i ? ",\n" : "\n") << "    {\"op\": " << jstr(r.spec->op) << ", \"case\": " << jstr(r.spec->name)
      << ", \"bytes\": " << jnum(r.spec->bytes) << ", \"flops\": " << jnum(r.spec->flops)
      << ", \"num_sets\": " << r.num_sets << ", \"us\": " << jnum(h ? h->median_us : NAN)
      << ", \"mode\": " << (h ? jstr(h == &r.graph ? "graph" : "stream") : "null")
      << ", \"graph_us\": " << jnum(r.graph.ok ? r.graph.median_us : NAN)
      << ", \"stream_us\": " << jnum(r.stream.ok ? r.stream.median_us : NAN) << ", \"gbps\": " << jnum(bw)
      << ", \"pct_copy_bw\": " << jnum(100.0 * bw * 1e9 / dev.copy.bytes_per_s)
      << ", \"pct_read_bw\": " << jnum(100.0 * bw * 1e9 / dev.read.bytes_per_s) << ", \"tflops\": " << jnum(tflops(r))
      << ", \"graph\": " << jtiming(r.graph) << ", \"stream\": " << jtiming(r.stream)
      << ", \"peer_of\": " << jlist(r.spec->peer_of) << ", \"peers\": " << jpeers(r, rows)
      << ", \"check\": " << (r.check == "-" ? "null" : jstr(r.check))
      << ", \"check_message\": " << (r.check_message.empty() ? "null" : jstr(r.check_message))
      << ", \"check_error\": " << jnum(r.check_error)
      << ", \"error\": " << (r.error.empty() ? "null" : jstr(r.error))
      << ", \"unsupported\": " << (r.unsupported.empty() ? "null" : jstr(r.unsupported)) << "}";
  }
  f << "\n  ]\n}\n";
  if (!f) throw Error("tessera-bench: error writing '" + path + "'");
}

// ---- running -------------------------------------------------------------------------------------------------
Device open_device(int ordinal) {
  Device d;
  d.ordinal = ordinal;
  TESSERA_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaDeviceProp prop{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  d.name = prop.name;
  int l2 = 0, sms = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, ordinal));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal));
  d.ctx.device = ordinal;
  d.ctx.l2_bytes = l2;
  d.ctx.num_sms = sms;
  return d;
}

// After a failure: wait for whatever is queued and clear a non-sticky error, so the next case starts clean.
void settle(cudaStream_t stream) {
  (void)cudaStreamSynchronize(stream);
  (void)cudaGetLastError();
}

Row run_case(const CaseSpec& spec, const Device& dev, cudaStream_t stream, const Options& o) {
  Row row;
  row.spec = &spec;
  try {
    std::unique_ptr<CaseInstance> inst = spec.setup(dev.ctx);
    row.num_sets = inst->num_sets();
    if (o.check) {
      try {
        const CheckResult r = inst->check(stream);
        row.check = r.ok ? "PASS" : "FAIL";
        row.check_message = r.message;
        row.check_error = r.error;
      } catch (const std::exception& e) {
        row.check = "FAIL";
        row.check_message = std::string("check threw: ") + e.what();
        settle(stream);
      }
    }
    try {
      row.stream = time_stream(*inst, stream, o.reps, o.warmup);
    } catch (const std::exception& e) {
      row.stream.error = e.what();
      note_error(row.error, std::string("stream mode: ") + e.what());
      settle(stream);
    }
    try {
      const int calls = graph_calls_for(row.stream.ok ? row.stream.median_us : -1.0, row.num_sets);
      row.graph = time_graph(*inst, stream, calls, o.reps, std::min(o.warmup, 3));
    } catch (const std::exception& e) {
      row.graph.error = e.what();
      note_error(row.error, std::string("graph mode: ") + e.what());
      settle(stream);
    }
  } catch (const Unsupported& e) {
    row.unsupported = e.what();
    settle(stream);
  } catch (const std::exception& e) {
    note_error(row.error, e.what());
    settle(stream);
  }
  return row;
}

int main_impl(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;

  // An --op item that names an op exactly selects only that op ("permute" is not "unpermute_reduce").
  std::vector<std::string> exact_ops, sub_ops;
  for (const std::string& item : o.ops) {
    const bool exact = std::any_of(case_registry().begin(), case_registry().end(),
                                   [&](const CaseSpec& c) { return c.op == item; });
    (exact ? exact_ops : sub_ops).push_back(item);
  }
  const auto op_selected = [&](const std::string& op) {
    return o.ops.empty() || std::find(exact_ops.begin(), exact_ops.end(), op) != exact_ops.end() ||
           (!sub_ops.empty() && matches(op, sub_ops));
  };
  std::vector<const CaseSpec*> selected;
  for (const CaseSpec& c : case_registry())
    if (op_selected(c.op) && matches(c.name, o.cases)) selected.push_back(&c);

  if (o.list) {
    int op_w = 18, name_w = 40;
    for (const CaseSpec* c : selected) {
      op_w = std::max(op_w, static_cast<int>(c->op.size()));
      name_w = std::max(name_w, static_cast<int>(c->name.size()));
    }
    std::printf("%-*s %-*s %12s %12s\n", op_w, "op", name_w, "case", "MB moved", "GFLOP");
    for (const CaseSpec* c : selected)
      std::printf("%-*s %-*s %12.3f %12s\n", op_w, c->op.c_str(), name_w, c->name.c_str(), c->bytes / 1e6,
                  c->flops > 0 ? fmt("%.3f", c->flops / 1e9).c_str() : "-");
    std::printf("%zu cases\n", selected.size());
    return 0;
  }
  if (selected.empty()) {
    std::fprintf(stderr, "tessera-bench: no case matches (try --list)\n");
    return 2;
  }

  Device dev;
  cudaStream_t stream = nullptr;
  try {
    dev = open_device(o.device);
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    dev.copy = measure_copy_bandwidth(stream, o.quick ? 5 : 20);
    dev.read = measure_read_bandwidth(stream, dev.ctx.num_sms, o.quick ? 5 : 20);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-bench: cannot set up the device: %s\n", e.what());
    return 2;
  }
  std::printf("device %d: %s, %d SMs, L2 %.1f MiB\n", dev.ordinal, dev.name.c_str(), dev.ctx.num_sms,
              dev.ctx.l2_bytes / 1048576.0);
  std::printf("copy bandwidth: %.1f GB/s (cudaMemcpyAsync device-to-device of %.0f MiB, read + write, median %.1f us)\n",
              dev.copy.bytes_per_s / 1e9, dev.copy.buffer_bytes / 1048576.0, dev.copy.median_us);
  std::printf("read bandwidth: %.1f GB/s (16-byte streaming loads over %.0f MiB, read only, median %.1f us)\n",
              dev.read.bytes_per_s / 1e9, dev.read.buffer_bytes / 1048576.0, dev.read.median_us);
  std::printf("reps %d, warmup %d%s\n\n", o.reps, o.warmup, o.check ? ", --check" : "");
  std::fflush(stdout);

  std::vector<Row> rows;
  for (size_t i = 0; i < selected.size(); ++i) {
    const CaseSpec& c = *selected[i];
    std::fprintf(stderr, "[%zu/%zu] %s %s ...\n", i + 1, selected.size(), c.op.c_str(), c.name.c_str());
    rows.push_back(run_case(c, dev, stream, o));
    const Row& r = rows.back();
    if (r.check == "FAIL") std::fprintf(stderr, "    check FAIL: %s\n", r.check_message.c_str());
    if (!r.error.empty()) std::fprintf(stderr, "    error: %s\n", r.error.c_str());
  }
  (void)cudaStreamDestroy(stream);

  print_table(rows, dev);
  print_details(rows, o.check);
  int rc = std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.failed(); }) ? 1 : 0;
  if (!o.json.empty()) {
    try {
      write_json(o.json, rows, dev, o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      rc = 1;
    }
  }
  return rc;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  try {
    return tessera::bench::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-bench: %s\n", e.what());
    return 2;
  }
}
