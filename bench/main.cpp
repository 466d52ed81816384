// tessera-bench: times the registered cases (CUDA graph and plain stream launches), relates them to the measured
// copy and read bandwidths, optionally checks them against the CPU reference, and prints a table (and optionally
// JSON / CSV). By default it runs the headline cases (CaseSpec::headline: every op, the rows docs/perf/*.md
// reports); --all runs every case. Progress with an ETA goes to stderr.
//
// Exit code: 0 all good, 1 a check failed or a case threw, 2 bad usage or no usable device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/tensor_map.h"
#include "harness.h"
#include "gpu_clock.h"
#include "timing.h"

namespace tessera::bench {
namespace {

struct Options {
  std::vector<std::string> ops;    // substrings of op names (any matches); empty = all
  std::vector<std::string> cases;  // substrings of case names (any matches); empty = all
  bool check = false;
  bool list = false;
  bool quick = false;
  bool all = false;
  bool host = false;
  int reps = -1;
  int warmup = -1;
  int device = 0;
  std::string json;
  std::string csv;
};

const char* kUsage =
    "usage: tessera-bench [options]\n"
    "  (default: the headline cases, every op and the rows of docs/perf/*.md; --list shows them)\n"
    "  --all           every case (the filters below then select among all of them)\n"
    "  --op LIST       only these ops: comma-separated op names (exact) or substrings of them\n"
    "                  (fused_gate, permute, unpermute_reduce, gate, grouped_gemm_fp8, cublaslt_fp8_loop, ...)\n"
    "  --case LIST     only cases whose name contains one of the comma-separated substrings (e.g. dsv3/T4096);\n"
    "                  without --all, among the headline cases, or among all cases if no headline case matches\n"
    "  --check         verify each case against the CPU reference before timing (FAIL -> exit code 1)\n"
    "  --json PATH     write all rows as JSON\n"
    "  --csv PATH      write all rows as CSV (the JSON row fields, one line per case, a header line)\n"
    "  --reps N        timed samples per mode (stream: calls; graph: replays); default 50, --quick 10\n"
    "  --warmup N      untimed calls before timing; default 10, --quick 3\n"
    "  --quick         fewer repetitions\n"
    "  --host          also the host time per call (C++, no Python: the stream held busy, calls timed with the\n"
    "                  host clock), against a bare launch measured the same way\n"
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
    } else if (a == "--csv") {
      if (!value(o.csv)) return false;
    } else if (a == "--all") {
      o.all = true;
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
    } else if (a == "--host") {
      o.host = true;
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
  double setup_s = 0, check_s = 0, timing_s = 0;  // host wall time of each phase
  ClockReading clock;         // SM clock and board power while graph mode was timed (gpu_clock.h)
  ClockReading stream_clock;  // the same for stream mode (timed first, right after setup and --check)
  double host_us = NAN;  // --host: the CPU's time per call (time_host)
  std::string host_detail;  // --host: where that time goes (CaseInstance::host_detail), where the case says

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
  ClockSampler* clocks = nullptr;  // NVML, where the driver has it
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
  // The SM clock and power of graph mode appear where NVML gave them.
  const bool clock_columns = std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.clock.ok(); });
  if (clock_columns) head.insert(head.end() - 1, {"SM MHz", "W"});
  if (peer_column) head.insert(head.end() - 1, "tessera/peer");
  std::vector<std::vector<std::string>> cells;
  for (const Row& r : rows) {
    const double bw = gbps(r);
    cells.push_back({r.spec->op, r.spec->name, r.graph.ok ? fmt("%.2f", r.graph.median_us) : "-",
                     r.stream.ok ? fmt("%.2f", r.stream.median_us) : "-", fmt("%.1f", bw),
                     fmt("%.1f", 100.0 * bw * 1e9 / dev.copy.bytes_per_s),
                     fmt("%.1f", 100.0 * bw * 1e9 / dev.read.bytes_per_s), fmt("%.3f", tflops(r)),
                     !r.unsupported.empty() ? "n/a" : r.error.empty() ? r.check : (r.check == "FAIL" ? "FAIL" : "ERROR")});
    if (clock_columns) {
      const bool capped = !reason_names(r.clock.reasons).empty();
      cells.back().insert(cells.back().end() - 1,
                          {r.clock.ok() ? fmt("%.0f", r.clock.sm_mhz) + (capped ? "*" : "") : "-",
                           r.clock.ok() && std::isfinite(r.clock.power_w) ? fmt("%.0f", r.clock.power_w) : "-"});
    }
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
  if (clock_columns)
    std::printf("(SM MHz: median SM clock while graph mode was timed, sampled by NVML every ~1 ms; *: the clock was "
                "held down (power cap, thermal) during it; W: mean board power over the same samples)\n");
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

// --host: calls per round and rounds (the median is reported) of time_host, for the cases and the bare launch alike.
constexpr int kHostCalls = 40, kHostReps = 9;

// --host: the CPU's time per call of each case (C++ only), and its excess over as many bare launches as fit in it.
struct HostFloor {
  double launch_us = NAN;            // a bare launch (8 bytes of parameters)
  double kilobyte_launch_us = NAN;   // the same with 1,024 bytes of parameters
  double get_device_us = NAN;        // one cudaGetDevice
  double map_hit_us = NAN;           // a tensor map of a tensor seen just before (the memo's hit)
  double map_miss_us = NAN;          // a tensor map of a tensor not in the memo (the driver's encode)
};

// Tensor maps of one shape over a 1 MiB device buffer, through the memo every op's maps go through: the same
// address every call (a hit), or a new address every call (a miss: the driver's encode; the few hundred calls of
// one measurement stay below the 4,000 distinct addresses the buffer holds maps for).
void time_tensor_maps(cudaStream_t stream, HostFloor& floor) {
  const DeviceBuffer buffer(4096 * 256);
  const int64_t dims[2] = {256, 64}, strides[1] = {256};
  const int box[2] = {64, 8};
  [[maybe_unused]] static volatile uint64_t sink;  // the map is used
  const auto map_at = [&](int i) {
    sink = detail::make_tensor_map_u8(buffer.as<uint8_t>() + 256 * (i % 4000), 2, dims, strides, box, 0,
                                      detail::L2Promotion::kNone)
               .opaque[0];
  };
  floor.map_hit_us = time_host_calls([&](int) { map_at(0); }, stream, kHostCalls * 25, kHostReps);
  int next = 0;
  floor.map_miss_us = time_host_calls([&](int) { map_at(++next); }, stream, kHostCalls, kHostReps);
}

void print_host(const std::vector<Row>& rows, const HostFloor& floor) {
  const double floor_us = floor.launch_us;
  std::printf("\nhost time per call (C++, no Python; the stream held busy, median of %d x %d calls); a bare launch: "
              "%.2f us (with 1 KiB of kernel parameters: %.2f us); cudaGetDevice: %.3f us; a tensor map: %.3f us "
              "from the memo, %.2f us encoded (a tensor not seen recently)\n",
              kHostReps, kHostCalls, floor_us, floor.kilobyte_launch_us, floor.get_device_us, floor.map_hit_us,
              floor.map_miss_us);
  int op_w = 18, name_w = 40;
  for (const Row& r : rows) {
    op_w = std::max(op_w, static_cast<int>(r.spec->op.size()));
    name_w = std::max(name_w, static_cast<int>(r.spec->name.size()));
  }
  std::printf("%-*s | %-*s | %8s | %14s\n", op_w, "op", name_w, "case", "host us", "/ bare launch");
  for (const Row& r : rows)
    if (std::isfinite(r.host_us))
      std::printf("%-*s | %-*s | %8.2f | %14.2f\n", op_w, r.spec->op.c_str(), name_w, r.spec->name.c_str(), r.host_us,
                  r.host_us / floor_us);
  for (const Row& r : rows)
    if (!r.host_detail.empty())
      std::printf("  %s %s: %s\n", r.spec->op.c_str(), r.spec->name.c_str(), r.host_detail.c_str());
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

// One row's fields, in JSON order: `json` is the JSON value; `csv` the CSV cell(s) (nested objects flattened to
// <key>.<field> columns, lists joined with ';').
struct Field {
  std::string key;
  std::string json;
  std::vector<std::pair<std::string, std::string>> csv;  // (column, cell text)
};

std::string plain(double v) {
  if (!std::isfinite(v)) return "";
  return jnum(v);
}

std::vector<Field> row_fields(const Row& r, const std::vector<Row>& rows, const Device& dev) {
  const ModeTiming* h = r.headline();
  const double bw = gbps(r);
  std::vector<Field> f;
  const auto num = [&](const std::string& k, double v) { f.push_back({k, jnum(v), {{k, plain(v)}}}); };
  const auto str = [&](const std::string& k, const std::string& v, bool null_if_empty) {
    f.push_back({k, null_if_empty && v.empty() ? "null" : jstr(v), {{k, v}}});
  };
  const auto timing = [&](const std::string& k, const ModeTiming& t) {
    Field fd{k, jtiming(t), {}};
    fd.csv = {{k + ".median_us", t.ok ? plain(t.median_us) : ""},
              {k + ".min_us", t.ok ? plain(t.min_us) : ""},
              {k + ".max_us", t.ok ? plain(t.max_us) : ""},
              {k + ".samples", t.ok ? std::to_string(t.samples) : ""},
              {k + ".calls_per_sample", t.ok ? std::to_string(t.calls_per_sample) : ""}};
    f.push_back(std::move(fd));
  };
  str("op", r.spec->op, false);
  str("case", r.spec->name, false);
  f.push_back({"headline", r.spec->headline ? "true" : "false", {{"headline", r.spec->headline ? "true" : "false"}}});
  num("bytes", r.spec->bytes);
  num("flops", r.spec->flops);
  f.push_back({"num_sets", std::to_string(r.num_sets), {{"num_sets", std::to_string(r.num_sets)}}});
  num("us", h ? h->median_us : NAN);
  str("mode", h ? (h == &r.graph ? "graph" : "stream") : "", true);
  num("graph_us", r.graph.ok ? r.graph.median_us : NAN);
  num("stream_us", r.stream.ok ? r.stream.median_us : NAN);
  num("gbps", bw);
  num("pct_copy_bw", 100.0 * bw * 1e9 / dev.copy.bytes_per_s);
  num("pct_read_bw", 100.0 * bw * 1e9 / dev.read.bytes_per_s);
  num("tflops", tflops(r));
  num("sm_mhz", r.clock.sm_mhz);
  num("min_sm_mhz", r.clock.min_mhz);
  num("power_w", r.clock.power_w);
  num("stream_sm_mhz", r.stream_clock.sm_mhz);
  num("stream_power_w", r.stream_clock.power_w);
  str("clock_limits", reason_names(r.clock.reasons), true);
  num("host_us", r.host_us);
  timing("graph", r.graph);
  timing("stream", r.stream);
  std::string peer_of_csv;
  for (const std::string& p : r.spec->peer_of) peer_of_csv += (peer_of_csv.empty() ? "" : ";") + p;
  f.push_back({"peer_of", jlist(r.spec->peer_of), {{"peer_of", peer_of_csv}}});
  std::string peers_csv;  // op:us:tessera_over_peer;...
  for (const Row* p : peers_of(r, rows)) {
    const ModeTiming* t = p->headline();
    peers_csv += (peers_csv.empty() ? "" : ";") + p->spec->op + ":" + plain(t ? t->median_us : NAN) + ":" +
                 plain(peer_ratio(r, *p));
  }
  f.push_back({"peers", jpeers(r, rows), {{"peers", peers_csv}}});
  str("check", r.check == "-" ? "" : r.check, true);
  str("check_message", r.check_message, true);
  num("check_error", r.check_error);
  str("error", r.error, true);
  str("unsupported", r.unsupported, true);
  num("setup_s", r.setup_s);
  num("check_s", r.check_s);
  num("timing_s", r.timing_s);
  return f;
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
    << ", \"quick\": " << (o.quick ? "true" : "false") << ", \"check\": " << (o.check ? "true" : "false")
    << ", \"all\": " << (o.all ? "true" : "false") << "},\n";
  f << "  \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << (i ? ",\n" : "\n") << "    {";
    bool first = true;
    for (const Field& fd : row_fields(rows[i], rows, dev)) {
      f << (first ? "" : ", ") << jstr(fd.key) << ": " << fd.json;
      first = false;
    }
    f << "}";
  }
  f << "\n  ]\n}\n";
  if (!f) throw Error("tessera-bench: error writing '" + path + "'");
}

// RFC 4180: quoted when it holds a comma, a quote or a line break; quotes doubled.
std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

void write_csv(const std::string& path, const std::vector<Row>& rows, const Device& dev) {
  std::ofstream f(path);
  if (!f) throw Error("tessera-bench: cannot open '" + path + "' for writing");
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::vector<Field> fields = row_fields(rows[i], rows, dev);
    std::string head, line;
    bool first = true;
    for (const Field& fd : fields)
      for (const auto& [col, cell] : fd.csv) {
        head += (first ? "" : ",") + csv_cell(col);
        line += (first ? "" : ",") + csv_cell(cell);
        first = false;
      }
    if (i == 0) f << head << "\n";
    f << line << "\n";
  }
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

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

Row run_case(const CaseSpec& spec, const Device& dev, cudaStream_t stream, const Options& o) {
  Row row;
  row.spec = &spec;
  Clock::time_point t0 = Clock::now();
  try {
    DeviceContext ctx = dev.ctx;
    ctx.stream = stream;
    std::unique_ptr<CaseInstance> inst = spec.setup(ctx);
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs are generated on `stream` (and uploads)
    row.num_sets = inst->num_sets();
    row.setup_s = seconds_since(t0);
    t0 = Clock::now();
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
    row.check_s = seconds_since(t0);
    t0 = Clock::now();
    try {
      if (dev.clocks) dev.clocks->start();
      row.stream = time_stream(*inst, stream, o.reps, o.warmup);
      if (dev.clocks) row.stream_clock = dev.clocks->stop();
    } catch (const std::exception& e) {
      if (dev.clocks) dev.clocks->stop();
      row.stream.error = e.what();
      note_error(row.error, std::string("stream mode: ") + e.what());
      settle(stream);
    }
    try {
      const int calls = graph_calls_for(row.stream.ok ? row.stream.median_us : -1.0, row.num_sets);
      if (dev.clocks) dev.clocks->start();
      row.graph = time_graph(*inst, stream, calls, o.reps, std::min(o.warmup, 3));
      if (dev.clocks) row.clock = dev.clocks->stop();
    } catch (const std::exception& e) {
      if (dev.clocks) dev.clocks->stop();
      row.graph.error = e.what();
      note_error(row.error, std::string("graph mode: ") + e.what());
      settle(stream);
    }
    if (o.host) {
      try {
        row.host_us = time_host(inst.get(), stream, kHostCalls, kHostReps);
        row.host_detail = inst->host_detail(stream, [&](const std::function<void(int)>& one) {
          return time_host_calls(one, stream, kHostCalls, kHostReps);
        });
      } catch (const std::exception& e) {
        note_error(row.error, std::string("host timing: ") + e.what());
        settle(stream);
      }
    }
    row.timing_s = seconds_since(t0);
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
  // The pool: the headline cases, or every case with --all; the filters select within it. Without --all, filters
  // that match no headline case fall back to every case (asking for a case by name gets it).
  std::vector<const CaseSpec*> selected;
  const auto select = [&](bool all) {
    selected.clear();
    for (const CaseSpec& c : case_registry())
      if ((all || c.headline) && op_selected(c.op) && matches(c.name, o.cases)) selected.push_back(&c);
  };
  select(o.all);
  if (selected.empty() && !o.all && (!o.ops.empty() || !o.cases.empty())) {
    select(true);
    if (!selected.empty())
      std::fprintf(stderr, "tessera-bench: no headline case matches; running the %zu matching cases of --all\n",
                   selected.size());
  }

  if (o.list) {
    int op_w = 18, name_w = 40;
    for (const CaseSpec* c : selected) {
      op_w = std::max(op_w, static_cast<int>(c->op.size()));
      name_w = std::max(name_w, static_cast<int>(c->name.size()));
    }
    std::printf("%-*s %-*s %8s %12s %12s\n", op_w, "op", name_w, "case", "headline", "MB moved", "GFLOP");
    for (const CaseSpec* c : selected)
      std::printf("%-*s %-*s %8s %12.3f %12s\n", op_w, c->op.c_str(), name_w, c->name.c_str(),
                  c->headline ? "*" : "", c->bytes / 1e6, c->flops > 0 ? fmt("%.3f", c->flops / 1e9).c_str() : "-");
    const auto headline = std::count_if(selected.begin(), selected.end(), [](const CaseSpec* c) { return c->headline; });
    std::printf("%zu cases (%ld headline)%s\n", selected.size(), static_cast<long>(headline),
                o.all ? "" : "; --all lists every case");
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
  ClockSampler clocks(dev.ordinal);
  if (clocks.available()) dev.clocks = &clocks;
  std::printf("device %d: %s, %d SMs, L2 %.1f MiB\n", dev.ordinal, dev.name.c_str(), dev.ctx.num_sms,
              dev.ctx.l2_bytes / 1048576.0);
  std::printf("SM clock and power: %s\n",
              clocks.available() ? "sampled by NVML while each case's graph mode is timed"
                                 : ("not reported (" + clocks.unavailable_reason() + ")").c_str());
  std::printf("copy bandwidth: %.1f GB/s (cudaMemcpyAsync device-to-device of %.0f MiB, read + write, median %.1f us)\n",
              dev.copy.bytes_per_s / 1e9, dev.copy.buffer_bytes / 1048576.0, dev.copy.median_us);
  std::printf("read bandwidth: %.1f GB/s (16-byte streaming loads over %.0f MiB, read only, median %.1f us)\n",
              dev.read.bytes_per_s / 1e9, dev.read.buffer_bytes / 1048576.0, dev.read.median_us);
  std::printf("reps %d, warmup %d%s, %zu %s cases\n\n", o.reps, o.warmup, o.check ? ", --check" : "", selected.size(),
              o.all ? "of all" : "headline / selected");
  std::fflush(stdout);

  HostFloor host_floor;  // --host: a bare launch and its neighbours, timed as the cases are
  if (o.host) {
    try {
      host_floor.launch_us = time_host(nullptr, stream, kHostCalls, kHostReps);
      host_floor.kilobyte_launch_us = time_host_calls([&](int) { launch_with_kilobyte_params(stream); }, stream,
                                                      kHostCalls, kHostReps);
      host_floor.get_device_us = time_host_calls(
          [&](int) {
            int d = 0;
            TESSERA_CUDA_CHECK(cudaGetDevice(&d));
          },
          stream, kHostCalls * 25, kHostReps);
      time_tensor_maps(stream, host_floor);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tessera-bench: host timing of a bare launch or a tensor map failed: %s\n", e.what());
      settle(stream);
    }
  }
  std::vector<Row> rows;
  const Clock::time_point run_start = Clock::now();
  for (size_t i = 0; i < selected.size(); ++i) {
    const CaseSpec& c = *selected[i];
    std::fprintf(stderr, "[%zu/%zu] %s %s ... ", i + 1, selected.size(), c.op.c_str(), c.name.c_str());
    const Clock::time_point t0 = Clock::now();
    rows.push_back(run_case(c, dev, stream, o));
    const Row& r = rows.back();
    // ETA: the mean time per case so far times the cases left.
    const double elapsed = seconds_since(run_start);
    const long eta = std::lround(elapsed / static_cast<double>(i + 1) * static_cast<double>(selected.size() - i - 1));
    std::fprintf(stderr, "%.1f s (ETA %ld:%02ld)%s\n", seconds_since(t0), eta / 60, eta % 60,
                 r.check == "FAIL" ? " check FAIL" : !r.error.empty() ? " ERROR" : "");
    if (r.check == "FAIL") std::fprintf(stderr, "    check FAIL: %s\n", r.check_message.c_str());
    if (!r.error.empty()) std::fprintf(stderr, "    error: %s\n", r.error.c_str());
  }
  (void)cudaStreamDestroy(stream);
  {
    double setup = 0, check = 0, timing = 0;
    for (const Row& r : rows) setup += r.setup_s, check += r.check_s, timing += r.timing_s;
    const long total = std::lround(seconds_since(run_start));
    std::fprintf(stderr, "tessera-bench: %zu cases in %ld:%02ld (setup %.1f s, check %.1f s, timing %.1f s)\n",
                 rows.size(), total / 60, total % 60, setup, check, timing);
  }

  print_table(rows, dev);
  if (o.host) print_host(rows, host_floor);
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
  if (!o.csv.empty()) {
    try {
      write_csv(o.csv, rows, dev);
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
