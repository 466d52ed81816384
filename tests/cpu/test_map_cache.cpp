// The host-side memo behind the tensor maps (src/common/map_cache.h): it returns exactly what was stored under a key,
// replaces the least recently used entry of a full set, and keeps a model-sized cycle of keys (one per layer and
// operand, as an engine's steps bring them) after the cycle's first round, where the 24-entry first-in-first-out memo
// it replaced missed on every call.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/gpu_util.h"
#include "common/map_cache.h"

namespace tessera::detail {
namespace {

// A key shaped like a tensor map's: an address and a few sizes.
struct Key {
  uint64_t data = 0;
  uint64_t rows = 0, cols = 0;
  bool operator==(const Key& o) const { return data == o.data && rows == o.rows && cols == o.cols; }
  uint64_t hash() const { return hash_finish(hash_mix(hash_mix(hash_mix(0, data), rows), cols)); }
};

using Cache = SetAssociativeCache<Key, uint64_t, 128, 16>;  // the tensor-map memo's shape

uint64_t value_of(const Key& k) { return k.data * 3 + k.rows * 5 + k.cols * 7; }

TEST(MapCache, ReturnsWhatWasStoredAndNothingElse) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  Cache cache;
  EXPECT_EQ(cache.find(Key{1, 2, 3}, Key{1, 2, 3}.hash()), nullptr);
  // Many more keys than the capacity, drawn from a small space so that keys repeat and sets overflow: a hit always
  // carries the value of its own key.
  std::uniform_int_distribution<uint64_t> small(0, 3999);
  int64_t hits = 0;
  for (int i = 0; i < 200000; ++i) {
    const Key k{0x7F0000000000ull + 256 * small(rng), 1 + small(rng) % 7, 128};
    if (const uint64_t* v = cache.find(k, k.hash())) {
      ASSERT_EQ(*v, value_of(k)) << "call " << i;
      ++hits;
    } else {
      cache.insert(k, k.hash(), value_of(k));
    }
  }
  EXPECT_GT(hits, 0);
}

TEST(MapCache, AFullSetReplacesItsLeastRecentlyUsedEntry) {
  SetAssociativeCache<Key, uint64_t, 4, 3> cache;
  const uint64_t same_set = 0x12345;  // every key given the same hash: one set of three ways
  const Key a{1, 1, 1}, b{2, 2, 2}, c{3, 3, 3}, d{4, 4, 4};
  for (const Key& k : {a, b, c}) cache.insert(k, same_set, value_of(k));
  ASSERT_NE(cache.find(a, same_set), nullptr);  // a is now the most recently used; b the least
  cache.insert(d, same_set, value_of(d));
  EXPECT_EQ(cache.find(b, same_set), nullptr) << "b was the least recently used";
  for (const Key& k : {a, c, d}) {
    const uint64_t* v = cache.find(k, same_set);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(*v, value_of(k));
  }
  // Equal hashes, different keys: never confused.
  EXPECT_EQ(cache.find(Key{5, 5, 5}, same_set), nullptr);
}

// The memo's use: a step of a 58-layer MoE model brings 12 maps a layer (two grouped GEMMs: the operands, the weights
// and their scales, each layer's own), 696 keys in a fixed cycle, step after step. After the first step every probe
// should hit, but for the keys of a set that overflows (more than 16 of the cycle's keys in one of 128 sets, rare at
// ~5.4 a set). The keys are the addresses and shapes such tensors have: deterministic, so this test cannot flake.
TEST(MapCache, AModelSizedCycleHitsAfterItsFirstRound) {
  Cache cache;
  std::vector<Key> cycle;
  for (uint64_t layer = 0; layer < 58; ++layer)
    for (uint64_t m = 0; m < 12; ++m)
      cycle.push_back(Key{0x7F3A00000000ull + layer * (uint64_t{1} << 28) + m * (uint64_t{1} << 22), 7168 + 16 * m,
                          m % 2 ? uint64_t{128} : uint64_t{256}});
  int64_t misses_first = 0, misses_later = 0;
  for (int step = 0; step < 5; ++step)
    for (const Key& k : cycle) {
      if (const uint64_t* v = cache.find(k, k.hash())) {
        EXPECT_EQ(*v, value_of(k));
        continue;
      }
      (step == 0 ? misses_first : misses_later) += 1;
      cache.insert(k, k.hash(), value_of(k));
    }
  EXPECT_EQ(misses_first, static_cast<int64_t>(cycle.size()));
  const int64_t probes = static_cast<int64_t>(cycle.size()) * 4;
  EXPECT_LE(misses_later, probes / 100) << "of " << probes << " probes";
  std::printf("[ map-cache] 696-key cycle: %lld misses in steps 2-5 (of %zu probes)\n",
              static_cast<long long>(misses_later), cycle.size() * 4);
}

}  // namespace
}  // namespace tessera::detail
