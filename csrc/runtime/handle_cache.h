// A bounded, least-recently-used cache of opened handles keyed by (peer, block):
// what the CUDA IPC channel keeps of the memory and events its peers exported
// (runtime/ipc_channel.h). Opening an IPC handle costs a driver call that
// maps memory (tens of microseconds or more); a pipeline sends from a small
// pool of blocks per peer, so after the first step every message finds its
// block here.
//
// Plain C++ with the open and close functions injected, so that its logic is
// tested without a device (bindings.cpp binds it for tests on every build as
// _C._HandleCache, with Python functions).
//
// Not thread-safe: one channel's executor thread uses it.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

namespace pipeline_ext {

template <typename Value, typename Arg>
class HandleCache {
 public:
  struct Key {
    int peer;
    int64_t block;
    bool operator<(const Key& o) const { return peer != o.peer ? peer < o.peer : block < o.block; }
    bool operator==(const Key& o) const { return peer == o.peer && block == o.block; }
  };
  // Opens the handle `arg` that `peer` sent for its block `block`. May throw: nothing is cached then.
  using Open = std::function<Value(int peer, int64_t block, const Arg& arg)>;
  // Closes an entry (evicted, its peer dropped, or the cache cleared). Must not throw.
  using Close = std::function<void(int peer, int64_t block, Value& value)>;

  HandleCache(size_t capacity, Open open, Close close)
      : capacity_(capacity), open_(std::move(open)), close_(std::move(close)) {
    if (capacity_ == 0) throw std::invalid_argument("HandleCache: the capacity must be at least 1");
  }
  ~HandleCache() { clear(); }
  HandleCache(const HandleCache&) = delete;
  HandleCache& operator=(const HandleCache&) = delete;

  // The entry of (peer, block), opened from `arg` when it is not cached (then
  // the least recently used entry is closed first if the cache is full). The
  // reference is valid until the next call that changes the cache.
  Value& get(int peer, int64_t block, const Arg& arg) {
    const Key key{peer, block};
    auto it = index_.find(key);
    if (it != index_.end()) {
      ++hits_;
      order_.splice(order_.begin(), order_, it->second);  // most recently used first
      return it->second->second;
    }
    ++misses_;
    Value value = open_(peer, block, arg);  // before evicting: a failed open leaves the cache as it was
    if (order_.size() >= capacity_) evict(std::prev(order_.end()));
    order_.emplace_front(key, std::move(value));
    index_.emplace(key, order_.begin());
    return order_.front().second;
  }

  bool contains(int peer, int64_t block) const { return index_.count(Key{peer, block}) > 0; }

  // Closes (peer, block) if cached (the peer retired the block); true if it was.
  bool erase(int peer, int64_t block) {
    auto it = index_.find(Key{peer, block});
    if (it == index_.end()) return false;
    evict(it->second, /*counted=*/false);
    return true;
  }

  // Closes every entry of `peer` (it exited or its channel closed); how many.
  size_t erase_peer(int peer) {
    std::vector<typename List::iterator> of_peer;
    for (auto it = index_.lower_bound(Key{peer, INT64_MIN}); it != index_.end() && it->first.peer == peer; ++it) {
      of_peer.push_back(it->second);
    }
    for (auto& e : of_peer) evict(e, /*counted=*/false);
    return of_peer.size();
  }

  void clear() {
    while (!order_.empty()) evict(std::prev(order_.end()), /*counted=*/false);
  }

  size_t size() const { return order_.size(); }
  size_t capacity() const { return capacity_; }
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }
  int64_t evictions() const { return evictions_; }
  // Keys from the most to the least recently used.
  std::vector<Key> keys() const {
    std::vector<Key> out;
    for (const auto& e : order_) out.push_back(e.first);
    return out;
  }

 private:
  using List = std::list<std::pair<Key, Value>>;

  void evict(typename List::iterator it, bool counted = true) {
    if (counted) ++evictions_;
    const Key key = it->first;
    index_.erase(key);
    Value value = std::move(it->second);
    order_.erase(it);
    close_(key.peer, key.block, value);
  }

  size_t capacity_;
  Open open_;
  Close close_;
  List order_;
  std::map<Key, typename List::iterator> index_;  // ordered: erase_peer walks one peer's range
  int64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

}  // namespace pipeline_ext
