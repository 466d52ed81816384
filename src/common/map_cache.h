// A bounded host-side memo: a set-associative cache of values under keys, least recently used entry replaced within
// a set. Sets × Ways entries, allocated on the first insert; a probe hashes once and compares at most Ways stored
// hashes (the full key only where the hash matches). Not thread-safe: keep one per thread.
//
// Why set-associative and this large (src/common/tensor_map.cpp): an engine calls each op once per layer per step,
// every layer on its own tensors, so the keys come round in a cycle as long as the model has layers. A small
// first-in-first-out memo (24 entries until session 25) misses on every call of such a cycle once it holds more keys
// than the memo; here a cycle of up to about a third of the capacity hits after its first round, but for the keys of
// a set that overflows (more than Ways of the cycle's keys in one set: with 16 ways and ~5.4 keys a set on average,
// about one set in 18,000; the keys of such a set then miss on every round).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace tessera::detail {

// A key's hash: hash_finish(hash_mix(hash_mix(0, field0), field1) ...). hash_mix folds a field in (one multiply);
// hash_finish spreads the result over all 64 bits (a 64-bit finalizer), so nearby pointers and sizes land in
// different sets.
constexpr uint64_t hash_mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x9E3779B97F4A7C15ull; }
constexpr uint64_t hash_finish(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

// Key: default-constructible, copyable, operator==; the caller passes hash(key), equal for equal keys. The stored
// hashes of a set lie side by side (a probe reads Ways of them in one or two cache lines), keys and values apart.
template <typename Key, typename Value, int Sets, int Ways>
class SetAssociativeCache {
  static_assert(Sets > 0 && (Sets & (Sets - 1)) == 0, "Sets must be a power of two");
  static_assert(Ways >= 1, "Ways must be >= 1");

 public:
  static constexpr int kCapacity = Sets * Ways;

  // The value stored under key, or null. A hit becomes its set's most recently used entry.
  const Value* find(const Key& key, uint64_t hash) {
    if (!slots_) return nullptr;
    const std::size_t first = set_of(hash);
    for (std::size_t e = first; e < first + Ways; ++e)
      if (hashes_[e] == hash && used_[e] != 0 && slots_[e].key == key) {
        used_[e] = ++tick_;
        return &slots_[e].value;
      }
    return nullptr;
  }

  // Stores value under key (which find did not return): in an empty way of its set, else in place of the set's least
  // recently used entry.
  void insert(const Key& key, uint64_t hash, const Value& value) {
    if (!slots_) {  // all three or none (find tests slots_ alone)
      auto hashes = std::make_unique<uint64_t[]>(static_cast<std::size_t>(kCapacity));
      auto used = std::make_unique<uint64_t[]>(static_cast<std::size_t>(kCapacity));
      slots_ = std::make_unique<Slot[]>(static_cast<std::size_t>(kCapacity));
      hashes_ = std::move(hashes);
      used_ = std::move(used);
    }
    const std::size_t first = set_of(hash);
    std::size_t victim = first;
    for (std::size_t e = first; e < first + Ways && used_[victim] != 0; ++e)
      if (used_[e] < used_[victim]) victim = e;
    slots_[victim].key = key;
    slots_[victim].value = value;
    hashes_[victim] = hash;
    used_[victim] = ++tick_;
  }

 private:
  struct Slot {
    Key key{};
    Value value{};
  };
  static std::size_t set_of(uint64_t hash) {
    return static_cast<std::size_t>((hash >> 7) & static_cast<uint64_t>(Sets - 1)) * Ways;
  }

  std::unique_ptr<Slot[]> slots_;
  std::unique_ptr<uint64_t[]> hashes_;
  std::unique_ptr<uint64_t[]> used_;  // the tick of each entry's last insert or hit; 0: empty
  uint64_t tick_ = 0;
};

}  // namespace tessera::detail
