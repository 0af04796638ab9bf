// ThreadSanitizer check of the live corpus's locking discipline (ngram_service.live.LiveCorpus):
// one ContextIndex, one mutex around every call, inserting threads (append, with evictions at the
// cap) and searching threads (continuation_after, memory_bytes, tokens) at once.  Build and run:
//   g++ -std=c++17 -O1 -g -fsanitize=thread -I ngram_service/csrc \
//       ngram_service/csrc/tsan/live_corpus_race.cpp ngram_service/csrc/context_index.cpp -o /tmp/live_tsan
//   /tmp/live_tsan         # the shipped corpus (suffixes of 8 tokens only); exit 0 and no
//   /tmp/live_tsan 4 1     # "WARNING: ThreadSanitizer" report: no data race (4 1: suffixes of 1..4)
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "context_index.hpp"

int main(int argc, char** argv) {
  const int max_context = argc > 2 ? std::atoi(argv[1]) : 8, min_context = argc > 2 ? std::atoi(argv[2]) : 8;
  dart_ngram::ContextIndex index(max_context, 1 << 14, min_context);  // a small cap: evicts and re-indexes often
  std::mutex lock;
  std::atomic<long> searches{0}, hits{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(w);
      for (int d = 0; d < 400; ++d) {
        std::vector<int64_t> doc(50 + rng() % 200);
        for (auto& t : doc) t = rng() % (max_context > 4 ? 2 : 64);
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
        int64_t query[8];
        for (auto& t : query) t = rng() % (max_context > 4 ? 2 : 64);  // a small alphabet: 8-token matches too
        std::lock_guard<std::mutex> g(lock);
        auto c = index.continuation_after(query, 8, 24);
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
