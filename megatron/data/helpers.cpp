// Index builders for the GPT/BERT datasets, compiled with pybind11.
//
// These loops walk every token position of a training run once, which is far too
// slow in Python for billion-token corpora; megatron/data/dataset_utils.py keeps
// pure-Python references with identical results that the tests compare against.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using SizesArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using DocIdxArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using WeightsArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Fills out[2 * k], out[2 * k + 1] with (position in doc_idx, token offset) of the
// first token of sample k, i.e. of token k * seq_length of the stream formed by
// concatenating the documents in doc_idx order.  Consecutive samples share one
// token: a sample is seq_length + 1 tokens so inputs and shifted labels are one slice.
// Sample 0 starts at (0, 0) even if that document is empty; later boundaries always
// point inside a non-empty document (offset < its size).
template <typename T>
void fill_sample_idx(const int32_t* sizes, int64_t num_sizes, const int64_t* doc_idx,
                     int64_t num_doc_idx, int64_t seq_length, int64_t num_samples, T* out) {
  int64_t pos = 0;     // index into doc_idx of the document holding the boundary
  int64_t offset = 0;  // token offset of the boundary inside that document
  out[0] = 0;
  out[1] = 0;
  for (int64_t k = 1; k <= num_samples; ++k) {
    int64_t advance = seq_length;
    while (true) {
      if (pos >= num_doc_idx) {
        throw std::runtime_error(
            "build_sample_idx: ran out of documents; num_epochs * tokens_per_epoch exceeds "
            "the tokens that sizes[doc_idx] hold");
      }
      const int64_t doc = doc_idx[pos];
      if (doc < 0 || doc >= num_sizes) {
        throw std::runtime_error("build_sample_idx: doc_idx entry " + std::to_string(doc) +
                                 " is outside sizes (length " + std::to_string(num_sizes) +
                                 ")");
      }
      // Tokens from the boundary (inclusive) to the end of this document.
      const int64_t left = static_cast<int64_t>(sizes[doc]) - offset;
      if (left > advance) {
        offset += advance;
        break;
      }
      advance -= left;
      ++pos;
      offset = 0;
    }
    out[2 * k] = static_cast<T>(pos);
    out[2 * k + 1] = static_cast<T>(offset);
  }
}

py::array build_sample_idx(const SizesArray& sizes, const DocIdxArray& doc_idx,
                           int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  if (sizes.ndim() != 1 || doc_idx.ndim() != 1) {
    throw std::invalid_argument("build_sample_idx: sizes and doc_idx must be 1-D arrays");
  }
  if (seq_length <= 0 || num_epochs <= 0 || tokens_per_epoch <= 0) {
    throw std::invalid_argument(
        "build_sample_idx: seq_length, num_epochs and tokens_per_epoch must be positive");
  }
  const int64_t total_tokens = num_epochs * tokens_per_epoch;
  const int64_t num_samples = (total_tokens - 1) / seq_length;
  // Offsets are bounded by int32 document sizes, so only the position column can
  // outgrow int32 (more than 2^31 documents over all epochs).
  const bool small = doc_idx.shape(0) < std::numeric_limits<int32_t>::max();
  const int32_t* s = sizes.data();
  const int64_t* d = doc_idx.data();
  if (small) {
    py::array_t<int32_t> out({num_samples + 1, static_cast<int64_t>(2)});
    int32_t* o = out.mutable_data();
    {
      py::gil_scoped_release release;
      fill_sample_idx<int32_t>(s, sizes.shape(0), d, doc_idx.shape(0), seq_length,
                               num_samples, o);
    }
    return out;
  }
  py::array_t<int64_t> out({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    fill_sample_idx<int64_t>(s, sizes.shape(0), d, doc_idx.shape(0), seq_length, num_samples,
                             o);
  }
  return out;
}

// Greedy interleaving: sample i goes to the dataset that is furthest behind its
// target share weight * i, so every prefix of the blend tracks the weights closely.
template <typename T>
void fill_blending(const double* weights, int64_t num_datasets, int64_t size, T* dataset_index,
                   int64_t* dataset_sample_index) {
  std::vector<int64_t> taken(num_datasets, 0);
  for (int64_t i = 0; i < size; ++i) {
    // max(i, 1) keeps the first choice on the heaviest dataset rather than dataset 0.
    const double scale = static_cast<double>(i > 0 ? i : 1);
    int64_t best = -1;
    double best_err = 0.0;
    for (int64_t j = 0; j < num_datasets; ++j) {
      // Zero-weight datasets are skipped outright: their error 0 - 0 could otherwise
      // win a tie against rounding-negative errors of the others.
      if (!(weights[j] > 0.0)) continue;
      const double err = weights[j] * scale - static_cast<double>(taken[j]);
      if (best < 0 || err > best_err) {
        best_err = err;
        best = j;
      }
    }
    dataset_index[i] = static_cast<T>(best);
    dataset_sample_index[i] = taken[best];
    ++taken[best];
  }
}

py::tuple build_blending_indices(const WeightsArray& weights, int64_t size) {
  if (weights.ndim() != 1 || weights.shape(0) == 0) {
    throw std::invalid_argument("build_blending_indices: weights must be a non-empty 1-D array");
  }
  if (size < 0) {
    throw std::invalid_argument("build_blending_indices: size must be >= 0");
  }
  const int64_t n = weights.shape(0);
  bool any_positive = false;
  for (int64_t j = 0; j < n; ++j) any_positive = any_positive || weights.data()[j] > 0.0;
  if (!any_positive) {
    throw std::invalid_argument("build_blending_indices: at least one weight must be positive");
  }
  py::array_t<int64_t> sample_index(size);
  int64_t* si = sample_index.mutable_data();
  const double* w = weights.data();
  if (n <= 255) {
    py::array_t<uint8_t> index(size);
    uint8_t* di = index.mutable_data();
    {
      py::gil_scoped_release release;
      fill_blending<uint8_t>(w, n, size, di, si);
    }
    return py::make_tuple(index, sample_index);
  }
  py::array_t<int32_t> index(size);
  int32_t* di = index.mutable_data();
  {
    py::gil_scoped_release release;
    fill_blending<int32_t>(w, n, size, di, si);
  }
  return py::make_tuple(index, sample_index);
}


// ---------------------------------------------------------------------------------------
// BERT sentence-pair sample mapping.
//
// A sample is a run of consecutive sentences of one document: (first sentence, end
// sentence (exclusive), target length).  The rules are Megatron-LM's (its build_mapping):
//
// * a document is skipped if it has fewer than min_num_sent sentences (2 when the
//   sentence-order head needs an A and a B part), or if it has two or more sentences and
//   one of them is longer than long_sentence_len tokens (512 in Megatron-LM);
// * a document is cut greedily: sentences are added until their tokens reach the target
//   length (max_num_tokens, or with probability short_seq_prob a uniform length in
//   [2, max_num_tokens]) and the run has min_num_sent sentences, but never so that a
//   single sentence is left over: the document's last run takes every remaining
//   sentence, so no sentence of a used document is dropped;
// * documents are walked in whole epochs: once max_num_samples samples exist the epoch
//   in progress is still completed, all samples are shuffled together and the first
//   max_num_samples are returned.  A run that needs fewer samples than one epoch holds
//   thus draws them from every document of its split (what Megatron-LM's training reads:
//   the first samples of its shuffled whole-epoch mapping), not from the first documents.
//
// All randomness comes from SplitMix64 so that the pure Python reference
// (megatron/data/bert_dataset.py) reproduces the mapping exactly.

constexpr int64_t kBertMappingVersion = 2;

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, n); the modulo bias is below 2^-40 for any n used here.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

int64_t draw_target(SplitMix64& rng, int64_t max_num_tokens, double short_seq_prob) {
  if (rng.uniform() < short_seq_prob) return 2 + rng.below(max_num_tokens - 1);
  return max_num_tokens;
}

void fill_bert_mapping(const int64_t* docs, int64_t num_docs, const int32_t* sizes,
                       int64_t num_sizes, int64_t max_num_samples, int64_t max_num_tokens,
                       double short_seq_prob, uint64_t seed, int64_t min_num_sent,
                       int64_t long_sentence_len, std::vector<int64_t>& out) {
  SplitMix64 rng(seed);
  int64_t count = 0;
  while (count < max_num_samples) {  // one whole epoch per pass
    const int64_t before = count;
    for (int64_t d = 0; d < num_docs; ++d) {
      const int64_t first = docs[d];
      const int64_t last = docs[d + 1];
      if (first < 0 || last > num_sizes || last < first) {
        throw std::runtime_error("build_bert_mapping: document boundaries outside the sentence "
                                 "sizes array");
      }
      if (last - first < min_num_sent) continue;
      if (last - first > 1 && long_sentence_len > 0) {
        bool long_sentence = false;
        for (int64_t s = first; s < last; ++s) {
          if (sizes[s] > long_sentence_len) {
            long_sentence = true;
            break;
          }
        }
        if (long_sentence) continue;
      }
      int64_t target = draw_target(rng, max_num_tokens, short_seq_prob);
      int64_t start = first;
      int64_t length = 0;
      for (int64_t s = first; s < last; ++s) {
        length += sizes[s];
        const int64_t n = s - start + 1;
        const int64_t remaining = last - s - 1;
        if ((length >= target && n >= min_num_sent && remaining > 1) || remaining == 0) {
          if (n >= min_num_sent) {
            out.push_back(start);
            out.push_back(s + 1);
            out.push_back(target);
            ++count;
          }
          start = s + 1;
          length = 0;
          target = draw_target(rng, max_num_tokens, short_seq_prob);
        }
      }
    }
    if (count == before) {
      throw std::runtime_error("build_bert_mapping: no document has enough sentences (need " +
                               std::to_string(min_num_sent) + " per sample, each of at most " +
                               std::to_string(long_sentence_len) + " tokens)");
    }
  }
  for (int64_t i = count - 1; i > 0; --i) {  // Fisher-Yates over whole rows
    const int64_t j = rng.below(i + 1);
    for (int k = 0; k < 3; ++k) std::swap(out[3 * i + k], out[3 * j + k]);
  }
  out.resize(static_cast<size_t>(3 * std::min(count, max_num_samples)));
}

py::array build_bert_mapping(const DocIdxArray& docs, const SizesArray& sizes,
                             int64_t max_num_samples, int64_t max_num_tokens,
                             double short_seq_prob, uint64_t seed, int64_t min_num_sent,
                             int64_t long_sentence_len) {
  if (docs.ndim() != 1 || sizes.ndim() != 1 || docs.shape(0) < 1) {
    throw std::invalid_argument("build_bert_mapping: docs (non-empty) and sizes must be 1-D");
  }
  if (max_num_samples < 0 || max_num_tokens < 2 || min_num_sent < 1) {
    throw std::invalid_argument("build_bert_mapping: need max_num_samples >= 0, "
                                "max_num_tokens >= 2 and min_num_sent >= 1");
  }
  if (!(short_seq_prob >= 0.0 && short_seq_prob <= 1.0)) {
    throw std::invalid_argument("build_bert_mapping: short_seq_prob must be in [0, 1]");
  }
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(3 * max_num_samples));
  {
    py::gil_scoped_release release;
    fill_bert_mapping(docs.data(), docs.shape(0) - 1, sizes.data(), sizes.shape(0),
                      max_num_samples, max_num_tokens, short_seq_prob, seed, min_num_sent,
                      long_sentence_len, rows);
  }
  const int64_t n = static_cast<int64_t>(rows.size() / 3);
  py::array_t<int64_t> out({n, static_cast<int64_t>(3)});
  std::copy(rows.begin(), rows.end(), out.mutable_data());
  return out;
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (sample index, blending index).";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "Return [num_samples + 1, 2] (doc_idx position, offset) of each sample start.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "Return (dataset_index, dataset_sample_index) of a weighted greedy interleave.");
  m.def("build_bert_mapping", &build_bert_mapping, py::arg("docs"), py::arg("sizes"),
        py::arg("max_num_samples"), py::arg("max_num_tokens"), py::arg("short_seq_prob"),
        py::arg("seed"), py::arg("min_num_sent"), py::arg("long_sentence_len"),
        "Return [n, 3] (first sentence, end sentence, target length) BERT samples.");
  m.attr("bert_mapping_version") = kBertMappingVersion;
}
