// The NCCL transport without a GPU (and, in CI, without libnccl): its allgatherv planning, the
// version decoding, loading the library and every way set-up can fail, each a CommError or
// std::invalid_argument with a message that names the problem, never a crash; and the parse and
// render steps of its benchmark. The collectives themselves are tested on a GPU
// (tests/cuda/test_nccl_transport.cpp).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bench_allgather_cuda.hpp"
#include "ciera/nccl.hpp"
#include "comm/nccl/allgatherv_plan.hpp"
#include "comm/nccl/library.hpp"

namespace ciera::nccl {
namespace {

using detail::AllgathervPlan;
using detail::plan_allgatherv;

AllgathervPlan plan(std::vector<uint64_t> counts, std::vector<uint64_t> displs) {
  return plan_allgatherv(counts, displs, static_cast<int>(counts.size()));
}

// ---- Planning an allgatherv -----------------------------------------------------------------

TEST(NcclAllgathervPlan, EqualRankMajorCountsAreOneAllgather) {
  const AllgathervPlan p = plan({100, 100, 100, 100}, {64, 164, 264, 364});
  EXPECT_TRUE(p.single_allgather);
  EXPECT_EQ(p.allgather_bytes, 100u);
  EXPECT_EQ(p.allgather_offset, 64u);
  EXPECT_TRUE(p.broadcasts.empty());
  ASSERT_EQ(p.written.size(), 1u);
  EXPECT_EQ(p.written[0].offset, 64u);
  EXPECT_EQ(p.written[0].bytes, 400u);
  EXPECT_EQ(p.extent, 464u);
}

TEST(NcclAllgathervPlan, OneRankIsOneAllgather) {
  const AllgathervPlan p = plan({7}, {3});
  EXPECT_TRUE(p.single_allgather);
  EXPECT_EQ(p.allgather_bytes, 7u);
  EXPECT_EQ(p.extent, 10u);
}

TEST(NcclAllgathervPlan, UnequalCountsAreOneBroadcastPerContributingRankInRankOrder) {
  // Ranks 1 and 3 contribute nothing; the ranges are not in rank order in the output.
  const AllgathervPlan p = plan({5, 0, 1000, 0, 1}, {1000, 0, 0, 7, 2000});
  EXPECT_FALSE(p.single_allgather);
  ASSERT_EQ(p.broadcasts.size(), 3u);
  EXPECT_EQ(p.broadcasts[0].root, 0);
  EXPECT_EQ(p.broadcasts[0].offset, 1000u);
  EXPECT_EQ(p.broadcasts[0].bytes, 5u);
  EXPECT_EQ(p.broadcasts[1].root, 2);
  EXPECT_EQ(p.broadcasts[1].offset, 0u);
  EXPECT_EQ(p.broadcasts[1].bytes, 1000u);
  EXPECT_EQ(p.broadcasts[2].root, 4);
  EXPECT_EQ(p.broadcasts[2].offset, 2000u);
  // Ranks 2 and 0 touch (0..1000, 1000..1005) and merge; the gap before 2000 stays the caller's.
  ASSERT_EQ(p.written.size(), 2u);
  EXPECT_EQ(p.written[0].offset, 0u);
  EXPECT_EQ(p.written[0].bytes, 1005u);
  EXPECT_EQ(p.written[1].offset, 2000u);
  EXPECT_EQ(p.written[1].bytes, 1u);
  EXPECT_EQ(p.extent, 2001u);
}

TEST(NcclAllgathervPlan, EqualCountsOutOfRankOrderAreBroadcasts) {
  const AllgathervPlan p = plan({8, 8, 8}, {16, 8, 0});
  EXPECT_FALSE(p.single_allgather);
  EXPECT_EQ(p.broadcasts.size(), 3u);
  ASSERT_EQ(p.written.size(), 1u);
  EXPECT_EQ(p.written[0].bytes, 24u);
}

TEST(NcclAllgathervPlan, EqualCountsWithGapsAreBroadcasts) {
  const AllgathervPlan p = plan({8, 8}, {0, 16});
  EXPECT_FALSE(p.single_allgather);
  EXPECT_EQ(p.written.size(), 2u);
}

TEST(NcclAllgathervPlan, NothingToGatherIsAnEmptyPlan) {
  for (const AllgathervPlan& p : {plan({0, 0, 0}, {0, 5, 9}), plan({0}, {0})}) {
    EXPECT_TRUE(p.empty());
    EXPECT_FALSE(p.single_allgather);
    EXPECT_TRUE(p.broadcasts.empty());
    EXPECT_EQ(p.extent, 0u);
  }
}

TEST(NcclAllgathervPlan, MisuseIsInvalidArgument) {
  const std::vector<uint64_t> two{1, 1};
  EXPECT_THROW(plan_allgatherv(two, two, 3), std::invalid_argument);  // wrong length
  EXPECT_THROW(plan_allgatherv(two, std::vector<uint64_t>{0}, 2), std::invalid_argument);
  EXPECT_THROW(plan_allgatherv({}, {}, 0), std::invalid_argument);
  EXPECT_THROW(plan({4, 4}, {0, 3}), std::invalid_argument);           // overlap
  EXPECT_THROW(plan({1, UINT64_MAX}, {0, 2}), std::invalid_argument);  // past 2^64
  try {
    plan({4, 4}, {0, 3});
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();
  }
}

// ---- Versions and the library -------------------------------------------------------------------

TEST(NcclLibrary, VersionCodesDecodeInBothSchemes) {
  const detail::Version v = detail::Version::from_code(22105);
  EXPECT_EQ(v.text(), "2.21.5");
  EXPECT_EQ(detail::Version::from_code(23203).text(), "2.32.3");
  EXPECT_EQ(detail::Version::from_code(2708).text(), "2.7.8");  // before 2.9: major*1000
  EXPECT_TRUE(v.at_least(2, 14));
  EXPECT_TRUE(v.at_least(2, 21));
  EXPECT_FALSE(v.at_least(2, 30));
  EXPECT_TRUE(detail::Version::from_code(30000).at_least(2, 30));
  EXPECT_FALSE(detail::Version::from_code(2708).at_least(2, 14));
}

TEST(NcclLibrary, AMissingFileIsACommErrorNamingIt) {
  try {
    detail::open_library("/nonexistent/libnccl.so.2");
    FAIL() << "loaded a file that does not exist";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/libnccl.so.2"), std::string::npos)
        << e.what();
  }
}

TEST(NcclLibrary, ALibraryThatIsNotNcclIsACommErrorNamingTheMissingFunction) {
  try {
    detail::open_library("libm.so.6");
    FAIL() << "took libm for NCCL";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("ncclGetVersion"), std::string::npos) << e.what();
  }
}

// The library is loaded once per process and then kept, so the override is seen by the first
// load only: skipped where an earlier test of this process loaded it. Decided before the
// override is set, so a library() that ignored the override and loaded NCCL still fails here.
TEST(NcclLibrary, CieraNcclLibraryOverridesTheSearchAndIsNamedWhenMissing) {
  if (detail::library_loaded()) {
    GTEST_SKIP()
        << "NCCL was loaded earlier in this process (the override applies to the first load)";
  }
  const char* previous = getenv("CIERA_NCCL_LIBRARY");
  const std::string saved = previous ? previous : "";
  setenv("CIERA_NCCL_LIBRARY", "/nonexistent/override/libnccl.so.2", 1);
  std::string why;
  const bool ok = available(&why);
  if (previous) {
    setenv("CIERA_NCCL_LIBRARY", saved.c_str(), 1);
  } else {
    unsetenv("CIERA_NCCL_LIBRARY");
  }
  EXPECT_FALSE(ok) << "the override was ignored: NCCL " << library_version() << " loaded";
  EXPECT_NE(why.find("/nonexistent/override/libnccl.so.2"), std::string::npos) << why;
  EXPECT_NE(why.find("CIERA_NCCL_LIBRARY"), std::string::npos) << why;
}

// ---- What is missing, and set-up without a GPU ------------------------------------------------

bool library_loads(std::string* why = nullptr) {
  try {
    library_version();
    return true;
  } catch (const CommError& e) {
    if (why) *why = e.what();
    return false;
  }
}

bool device_present() {
  int count = 0;
  const bool present = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return present;
}

TEST(NcclHost, AvailableNamesEverythingMissing) {
  std::string why;
  const bool ok = available(&why);
  EXPECT_EQ(ok, library_loads() && device_present());
  EXPECT_EQ(ok, why.empty()) << why;
  if (!library_loads()) {
    EXPECT_NE(why.find("libnccl.so.2"), std::string::npos) << why;
  }
  if (!device_present()) {
    EXPECT_NE(why.find("CUDA device"), std::string::npos) << why;
  }
  EXPECT_EQ(available(), ok);  // without a reason asked for
}

TEST(NcclHost, WithoutNcclEveryEntryPointIsACommError) {
  std::string why;
  if (library_loads(&why)) GTEST_SKIP() << "NCCL " << library_version() << " loads here";
  EXPECT_NE(why.find("libnccl.so.2"), std::string::npos) << why;
  EXPECT_THROW(library_version(), CommError);
  EXPECT_THROW(make_unique_id(), CommError);
  EXPECT_THROW(make_transport(UniqueId{}, 0, 1), CommError);
}

TEST(NcclHost, LoadedLibraryReportsItsVersion) {
  if (!library_loads()) GTEST_SKIP() << "no NCCL here";
  const detail::Library& lib = detail::library();
  EXPECT_EQ(library_version(), lib.version.text());
  EXPECT_TRUE(lib.version.at_least(detail::kOldestSupported.major, detail::kOldestSupported.minor));
}

TEST(NcclHost, SetUpWithoutADeviceIsACommErrorNamingIt) {
  if (!library_loads() || device_present()) GTEST_SKIP() << "needs NCCL and no GPU";
  try {
    make_transport(make_unique_id(), 0, 1, {.device = 0, .timeout = std::chrono::seconds(5)});
    FAIL() << "a transport without a GPU";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA device 0"), std::string::npos) << e.what();
  }
}

TEST(NcclHost, RankAndSizeOutOfRangeAreInvalidArguments) {
  // Checked before NCCL is even loaded: misuse on this rank alone.
  EXPECT_THROW(make_transport(UniqueId{}, 0, 0), std::invalid_argument);
  EXPECT_THROW(make_transport(UniqueId{}, 2, 2), std::invalid_argument);
  EXPECT_THROW(make_transport(UniqueId{}, -1, 2), std::invalid_argument);
  EXPECT_THROW(make_transport(UniqueId{}, 0, 2, {.device = -1}), std::invalid_argument);
  EXPECT_THROW(
      make_transport(UniqueId{}, 0, 2, {.device = 0, .timeout = std::chrono::milliseconds(-1)}),
      std::invalid_argument);
}

// ---- The benchmark's parse and render steps (tools/bench_allgather_cuda.hpp) -------------------

TEST(NcclBench, SizesParseWithBinaryUnits) {
  EXPECT_EQ(tools::parse_byte_sizes("4M,64M,1G,4096,2K", "--sizes"),
            (std::vector<uint64_t>{4u << 20, 64u << 20, 1u << 30, 4096, 2048}));
  for (const char* bad : {"", "4Q", "M", "4M,", "-4", "0", "1T"}) {
    try {
      tools::parse_byte_sizes(bad, "--sizes");
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--sizes"), std::string::npos) << e.what();
    }
  }
}

TEST(NcclBench, BadOptionsAreNamedBeforeAnyWork) {
  auto rejects = [](tools::NcclBenchOptions o, const std::string& option) {
    try {
      tools::check_nccl_bench_options(o);
      ADD_FAILURE() << option << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(option), std::string::npos) << e.what();
    }
  };
  tools::NcclBenchOptions o;
  EXPECT_NO_THROW(tools::check_nccl_bench_options(o));
  o.ranks = 0;
  rejects(o, "--ranks");
  o = {};
  o.steps = o.warmup;
  rejects(o, "--steps");
  o = {};
  o.sizes = {7};  // less than one BF16 value per rank
  rejects(o, "--sizes");
  o = {};
  o.timeout_s = 0;
  rejects(o, "--timeout");
  o = {};
  o.dtype = "int8";
  EXPECT_THROW(tools::check_nccl_bench_options(o), ConfigError);
}

TEST(NcclBench, WithoutAGpuItSaysWhyInOneLine) {
  if (available()) GTEST_SKIP() << "NCCL and a GPU are here";
  tools::NcclBenchOptions o;
  o.quiet = true;
  try {
    tools::measure_nccl_allgather(o);
    FAIL() << "measured without NCCL or a GPU";
  } catch (const tools::NcclBenchUnavailable& e) {
    const std::string text = e.what();
    EXPECT_EQ(text.rfind("--device cuda: ", 0), 0u) << text;
    EXPECT_EQ(text.find('\n'), std::string::npos) << text;
  }
}

tools::NcclBenchResult sample_result() {
  tools::NcclBenchResult r;
  r.gpu = "NVIDIA H200 \"test\"";
  r.gpus = 1;
  r.ranks_share_gpus = true;
  r.nccl_version = "2.32.3";
  tools::NcclBenchSize s;
  s.bytes = 4 << 20;
  s.nccl_s = 0.001;
  s.ciera_s = 0.0008;
  s.wire_bytes = 3 << 20;
  r.sizes = {s, s};
  r.sizes[1].bytes = 64 << 20;
  return r;
}

TEST(NcclBench, JsonAndTableReportTheSameNumbers) {
  tools::NcclBenchOptions o;
  o.command = "ciera_nccl_bench --sizes 4M,64M";
  tools::NcclBenchResult r = sample_result();
  const std::string json = tools::nccl_bench_json(o, r);
  EXPECT_NE(json.find("\"bytes_raw\": 4194304"), std::string::npos) << json;
  EXPECT_NE(json.find("\"raw_algbw_GBps\": 4.1943"), std::string::npos) << json;  // 4 MiB in 1 ms
  EXPECT_NE(json.find("\"raw_busbw_GBps\": 3.145728"), std::string::npos)
      << json;  // * 3/4 (4 ranks)
  EXPECT_NE(json.find("\"ratio\": 1.33333"), std::string::npos) << json;
  EXPECT_NE(json.find("\"verified\": true"), std::string::npos) << json;
  EXPECT_NE(json.find("H200 \\\"test\\\""), std::string::npos) << json;  // escaped
  int depth = 0;
  for (const char c : json) depth += c == '{' || c == '[' ? 1 : c == '}' || c == ']' ? -1 : 0;
  EXPECT_EQ(depth, 0) << json;
  const std::string table = tools::nccl_bench_table(o, r);
  EXPECT_NE(table.find("ncclAllGather ms"), std::string::npos) << table;
  EXPECT_NE(table.find("4.19"), std::string::npos) << table;
  EXPECT_NE(table.find("1.333"), std::string::npos) << table;
  EXPECT_NE(table.find("wrong elements (CIERA vs ncclAllGather, all ranks, all steps): 0"),
            std::string::npos)
      << table;

  r.sizes[1].wrong_elements = 3;
  EXPECT_FALSE(r.verified());
  EXPECT_NE(tools::nccl_bench_json(o, r).find("\"verified\": false"), std::string::npos);
  EXPECT_NE(tools::nccl_bench_table(o, r).find("all steps): 3"), std::string::npos);
  r = sample_result();
  r.sizes[0].disagreeing_steps = 1;
  EXPECT_FALSE(r.verified());
  EXPECT_NE(tools::nccl_bench_table(o, r).find("agree across ranks: NO"), std::string::npos);
}

}  // namespace
}  // namespace ciera::nccl
