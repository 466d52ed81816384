// A bounded host-side memo: a set-associative cache of values under keys, least recently used entry replaced within
// a set. Sets × Ways entries, allocated on the first insert; a probe hashes once and compares at most Ways stored
// hashes (the full key only where the hash matches). Not thread-safe: keep one per thread.
//
// Why set-associative and this large (src/common/tensor_map.cpp): an engine calls each op once per layer per step,
// every layer on its own tensors, so the keys come round in a cycle as long as the model has layers. A small
// first-in-first-out memo (24 entries until session 25) misses on every call of such a cycle once it holds more keys
// than the memo; here a cycle of up to about a third of the capacity hits after its first round (a set overflows
// only when more than Ways of the cycle's keys hash into it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace tessera::detail {

// Mixes v into the running hash h (a 64-bit finalizer, so nearby pointers and sizes spread over the sets).
constexpr uint64_t hash_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

// Key: default-constructible, copyable, operator==; the caller passes hash(key), equal for equal keys.
template <typename Key, typename Value, int Sets, int Ways>
class SetAssociativeCache {
  static_assert(Sets > 0 && (Sets & (Sets - 1)) == 0, "Sets must be a power of two");
  static_assert(Ways >= 1, "Ways must be >= 1");

 public:
  static constexpr int kCapacity = Sets * Ways;

  // The value stored under key, or null. A hit becomes its set's most recently used entry.
  const Value* find(const Key& key, uint64_t hash) {
    if (!entries_) return nullptr;
    Entry* set = &entries_[set_of(hash)];
    for (int w = 0; w < Ways; ++w) {
      Entry& e = set[w];
      if (e.used != 0 && e.hash == hash && e.key == key) {
        e.used = ++tick_;
        return &e.value;
      }
    }
    return nullptr;
  }

  // Stores value under key (which find did not return): in an empty way of its set, else in place of the set's least
  // recently used entry.
  void insert(const Key& key, uint64_t hash, const Value& value) {
    if (!entries_) entries_ = std::make_unique<Entry[]>(static_cast<std::size_t>(kCapacity));
    Entry* set = &entries_[set_of(hash)];
    Entry* victim = &set[0];
    for (int w = 0; w < Ways && victim->used != 0; ++w)
      if (set[w].used < victim->used) victim = &set[w];
    victim->key = key;
    victim->value = value;
    victim->hash = hash;
    victim->used = ++tick_;
  }

 private:
  struct Entry {
    Key key{};
    Value value{};
    uint64_t hash = 0;
    uint64_t used = 0;  // the tick of the last insert or hit; 0: empty
  };
  static std::size_t set_of(uint64_t hash) {
    return static_cast<std::size_t>((hash >> 7) & static_cast<uint64_t>(Sets - 1)) * Ways;
  }

  std::unique_ptr<Entry[]> entries_;
  uint64_t tick_ = 0;
};

}  // namespace tessera::detail
