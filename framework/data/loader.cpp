#include "framework/data/loader.h"

#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/data/data_error.h"

namespace strobe::data {

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, CollateFn collate, LoaderOptions options)
    : dataset_(std::move(dataset)),
      collate_(std::move(collate)),
      opt_(options),
      sampler_(dataset_->size(), SamplerOptions{options.shuffle, options.drop_last, options.seed, options.rank,
                                                options.world_size}) {
  if (opt_.batch_size < 1) throw std::invalid_argument("loader: batch_size must be >= 1");
  if (opt_.num_workers < 0) throw std::invalid_argument("loader: num_workers must be >= 0");
  if (opt_.prefetch_factor < 1) opt_.prefetch_factor = 1;
}

DataLoader::~DataLoader() { stop(); }

int64_t DataLoader::num_batches() const {
  int64_t n = sampler_.num_samples();
  int64_t full = opt_.drop_last ? n / opt_.batch_size : (n + opt_.batch_size - 1) / opt_.batch_size;
  return opt_.limit_batches >= 0 ? std::min(full, opt_.limit_batches) : full;
}

Batch DataLoader::make_batch(int64_t epoch, int64_t batch_index) const {
  std::vector<int64_t> other_epoch;
  const std::vector<int64_t>* order_ptr = &order_;
  if (epoch != epoch_ || order_.empty()) {
    other_epoch = sampler_.indices(epoch);
    order_ptr = &other_epoch;
  }
  const std::vector<int64_t>& order = *order_ptr;
  int64_t begin = batch_index * opt_.batch_size;
  int64_t end = std::min<int64_t>(begin + opt_.batch_size, static_cast<int64_t>(order.size()));
  if (begin >= end) throw std::out_of_range("loader: batch index past the end of the epoch");
  std::vector<Sample> samples;
  samples.reserve(end - begin);
  for (int64_t k = begin; k < end; ++k) {
    at::Generator gen = sample_generator(opt_.seed, epoch, order[k]);
    Sample s = dataset_->get(order[k], gen);
    // An empty sample is one a dataset skipped as bad (on_bad_sample: skip; it logged it): the batch
    // is one smaller. Which samples are bad depends only on the files, so batches stay exact.
    if (!s.empty()) samples.push_back(std::move(s));
  }
  if (samples.empty())
    throw DataError(fmt::format("batch {} of epoch {}: every one of its {} samples was bad and skipped", batch_index, epoch, end - begin));
  Batch b = collate_(samples);
  if (!b.meta.count("batch_size")) b.meta["batch_size"] = end - begin;
  b.meta[kMetaBatchIndex] = batch_index;
  b.meta[kMetaEpoch] = epoch;
  return opt_.pin_memory ? b.pin_memory() : b;
}

void DataLoader::start(int64_t epoch, int64_t first_batch) {
  stop();
  std::unique_lock<std::mutex> lock(mu_);
  epoch_ = epoch;
  order_ = sampler_.indices(epoch);
  end_ = num_batches();
  next_to_make_ = next_to_yield_ = std::min(first_batch, end_);
  ready_.clear();
  error_ = nullptr;
  stopping_ = false;
  ++generation_;
  for (int64_t w = 0; w < opt_.num_workers; ++w)
    workers_.emplace_back(&DataLoader::worker_loop, this, w, generation_);
}

void DataLoader::worker_loop(int64_t /*worker_id*/, uint64_t generation) {
  // Workers make batches in index order; the bound keeps at most num_workers * prefetch_factor
  // batches ahead of the consumer.
  const int64_t capacity = opt_.num_workers * opt_.prefetch_factor;
  for (;;) {
    int64_t index;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_space_.wait(lock, [&] { return stopping_ || next_to_make_ - next_to_yield_ < capacity || next_to_make_ >= end_; });
      if (stopping_ || generation != generation_ || next_to_make_ >= end_ || error_) return;
      index = next_to_make_++;
    }
    try {
      Batch b = make_batch(epoch_, index);
      std::lock_guard<std::mutex> lock(mu_);
      if (generation != generation_) return;
      ready_.emplace(index, std::move(b));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    cv_made_.notify_all();
  }
}

std::optional<Batch> DataLoader::next() {
  if (opt_.num_workers == 0) {
    if (next_to_yield_ >= end_) return std::nullopt;
    return make_batch(epoch_, next_to_yield_++);
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (next_to_yield_ >= end_) return std::nullopt;
  cv_made_.wait(lock, [&] { return error_ || ready_.count(next_to_yield_) > 0; });
  if (error_) {
    auto e = error_;
    lock.unlock();
    stop();
    std::rethrow_exception(e);
  }
  auto it = ready_.find(next_to_yield_);
  Batch b = std::move(it->second);
  ready_.erase(it);
  ++next_to_yield_;
  lock.unlock();
  cv_space_.notify_all();
  return b;
}

void DataLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_space_.notify_all();
  cv_made_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  ready_.clear();
}

}  // namespace strobe::data

namespace strobe::data {
void DataLoader::set_shuffle(bool shuffle) {
  stop();
  opt_.shuffle = shuffle;
  sampler_ = DistributedSampler(dataset_->size(), SamplerOptions{opt_.shuffle, opt_.drop_last, opt_.seed, opt_.rank, opt_.world_size});
}
}  // namespace strobe::data
