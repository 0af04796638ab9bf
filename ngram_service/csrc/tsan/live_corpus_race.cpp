// ThreadSanitizer check of the live corpus's locking discipline (ngram_service.live.LiveCorpus):
// one ContextIndex, one mutex around every call, inserting threads (append, with evictions at the
// cap) and searching threads (continuation_after, memory_bytes, tokens) at once.  Build and run:
//   g++ -std=c++17 -O1 -g -fsanitize=thread -I ngram_service/csrc \
//       ngram_service/csrc/tsan/live_corpus_race.cpp ngram_service/csrc/context_index.cpp -o /tmp/live_tsan
//   /tmp/live_tsan     # exit 0 and no "WARNING: ThreadSanitizer" report: no data race
#include <atomic>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "context_index.hpp"

int main() {
  dart_ngram::ContextIndex index(4, 1 << 14);  // a small cap: inserts evict and re-index often
  std::mutex lock;
  std::atomic<long> searches{0}, hits{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(w);
      for (int d = 0; d < 400; ++d) {
        std::vector<int64_t> doc(50 + rng() % 200);
        for (auto& t : doc) t = rng() % 64;
        doc.push_back(dart_ngram::ContextIndex::kBoundary);
        std::lock_guard<std::mutex> g(lock);
        index.append(doc.data(), doc.size());
      }
    });
  }
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 rng(100 + r);
      for (int q = 0; q < 4000; ++q) {
        int64_t query[4];
        for (auto& t : query) t = rng() % 64;
        std::lock_guard<std::mutex> g(lock);
        auto c = index.continuation_after(query, 4, 24);
        hits += !c.tokens.empty();
        if (q % 100 == 0) (void)index.memory_bytes(), (void)index.tokens().size();
        ++searches;
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("searches %ld, hits %ld, tokens held %zu\n", searches.load(), hits.load(), index.size());
  return 0;
}
