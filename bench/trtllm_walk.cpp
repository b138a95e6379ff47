// Host cost of one radix-tree prefix walk as TensorRT-LLM's C++ scheduler performs it
// (BlockManager::findNewContextBlock / analyzePrefixReuse, once per active context request
// on every scheduler pass; storeContextBlocks and releaseBlocks -> storeBlocks do the same
// chop / key / find walk over every full block when a request retires): our own code
// doing the same data operations, not TensorRT-LLM's. Feeds RoundCostSpec.walk_s_per_token
// and TrtllmLoopCosts (prefill_node/sim/specs.py, prefill_node/sim/trtllm_costs.py).
//
//   g++ -O2 -std=c++17 bench/trtllm_walk.cpp -o /tmp/trtllm_walk && nice -n 19 /tmp/trtllm_walk
//
// Measured on the development VM (2 shared cores, nice 19), best of 50 per prompt, three
// runs on 2026-11-29: a 131,072-token prompt with 126,976 tokens cached in 32-token blocks
// 3.83 / 3.86 / 4.96 ms (27 ns per token); the same length with nothing cached 0.44 / 0.45 /
// 0.51 ms: 3.4 ns per prompt token (copy, chop, build keys) + 27 ns per cached token (hash
// each key, find it, append its tokens to the running key).
// The walk: copy the prompt's tokens, cut them into per-block keys, then walk a tree of
// hash maps from the root, hashing each key (per-token hash combine) and comparing it.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <list>
#include <memory>
#include <random>
#include <unordered_map>
#include <vector>
struct Tok { int32_t id; uint64_t extra; bool operator==(const Tok&o) const {return id==o.id&&extra==o.extra;} };
struct Key { std::vector<Tok> toks; bool operator==(const Key&o) const {return toks==o.toks;} };
struct KeyHash { size_t operator()(const Key&k) const { uint64_t h = k.toks.size();
  for (auto const&t: k.toks) { uint64_t a = (uint64_t)t.id; a = ((a>>16)^a)*0x45d9f3b; a=((a>>16)^a)*0x45d9f3b; a=(a>>16)^a;
    h ^= a + 0x9e3779b9 + (h<<6) + (h>>2); if (t.extra) { uint64_t e=t.extra; e=(e^(e>>30))*0xbf58476d1ce4e5b9ULL; h^= e + 0x9e3779b9 + (h<<6) + (h>>2);} }
  return h; } };
struct Node { std::unordered_map<Key, std::shared_ptr<Node>, KeyHash> kids; };
static double best_walk_s(const std::shared_ptr<Node>& root, const std::vector<Tok>& prompt, int B, int reps,
                          size_t& matched_out) {
  volatile size_t sink = 0; double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Tok> copy = prompt;                       // getUniqueTokens(0) by value
    std::list<std::vector<Tok>> blocks;                   // chop into blocks
    for (size_t i = 0; i + B <= copy.size(); i += B) blocks.emplace_back(copy.begin()+i, copy.begin()+i+B);
    std::list<Key> keys; for (auto& b: blocks) keys.push_back(Key{b});   // build keys
    Key ret; auto node = root; size_t matched = 0;
    for (auto const& k: keys) { ret.toks.insert(ret.toks.end(), k.toks.begin(), k.toks.end());
      auto it = node->kids.find(k); if (it == node->kids.end()) break; node = it->second; ++matched; }
    sink += matched + ret.toks.size(); matched_out = matched;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); if (s < best) best = s;
  }
  return best;
}
int main(int argc, char** argv) {
  const int L = 131072, B = 32, suffix = 4096, reps = 50;
  std::mt19937 rng(0); std::vector<Tok> prompt(L), cold(L);
  for (auto& t: prompt) t = Tok{(int32_t)(rng()%150000), 0};
  for (auto& t: cold) t = Tok{(int32_t)(rng()%150000), 0};
  auto root = std::make_shared<Node>(); auto cur = root;
  for (int b = 0; b < (L - suffix)/B; ++b) { Key k; k.toks.assign(prompt.begin()+b*B, prompt.begin()+(b+1)*B);
    auto n = std::make_shared<Node>(); cur->kids.emplace(k, n); cur = n; }
  size_t mw = 0, mc = 0;
  double warm = best_walk_s(root, prompt, B, reps, mw), coldt = best_walk_s(root, cold, B, reps, mc);
  std::printf("walk of %d-token prompt (%zu tokens cached): best %.3f ms = %.1f ns/token\n", L, mw*B, warm*1e3, warm/L*1e9);
  std::printf("walk of %d-token prompt (%zu tokens cached): best %.3f ms = %.1f ns/token\n", L, mc*B, coldt*1e3, coldt/L*1e9);
  std::printf("=> %.1f ns per prompt token + %.1f ns per cached token\n", coldt/L*1e9, (warm-coldt)/(mw*B)*1e9);
}
