#include "strobe/data/loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "strobe/data/data_error.h"
#include "strobe/data/packing.h"

namespace strobe::data {

struct DataLoader::Impl {
  std::shared_ptr<const std::vector<int64_t>> order;  // this epoch's units (null before the first start)
  int64_t epoch = 0, next_to_make = 0, next_to_yield = 0, end = 0;
  int64_t offset = 0;  // samples of the epoch's order (all ranks) before this split's first batch
  uint64_t generation = 0;
  bool stopping = false;
  std::map<int64_t, Batch> ready;
  // The first failed batch's error and index: next() raises it at that batch's turn, after every
  // batch before it (in order, as a loader without workers would; a resume then starts at it).
  std::exception_ptr error;
  int64_t error_index = -1;
  // Lookahead (LoaderOptions::lookahead): the next epoch's first batches, made once every batch of
  // this epoch is made or being made; start(epoch + 1, 0) takes them over.
  struct Ahead {
    int64_t epoch = -1;  // -1: not planned yet
    std::shared_ptr<const std::vector<int64_t>> order;
    int64_t end = 0, next_to_make = 0;
    std::map<int64_t, Batch> ready;
    std::exception_ptr error;
    int64_t error_index = -1;
    bool planning = false;  // a worker is computing the next epoch's order
  } ahead;
  std::mutex mu;
  std::condition_variable cv_made, cv_space;
  std::vector<std::thread> workers;
  // Packing: the plans of the latest two epochs asked for (the current one and, ahead, the next).
  std::mutex plan_mu;
  std::map<int64_t, std::shared_ptr<const RowPlan>> plans;

  void worker_loop(const DataLoader& loader, uint64_t gen);
};

namespace {
// Set while this thread's loader, pinning its batches, runs the collate (collate_pins(), dataset.h).
thread_local bool collate_pins_now = false;

struct CollatePinScope {
  explicit CollatePinScope(bool pins) : before(collate_pins_now) { collate_pins_now = pins; }
  ~CollatePinScope() { collate_pins_now = before; }
  bool before;
};

// A worker's torch ops run on one thread: the workers are the loader's parallelism. Each worker
// would otherwise start an OpenMP team of as many threads as there are cores for every large op
// (12 workers x 16 threads on 16 cores), and the main thread's steps would wait on them.
// omp_set_num_threads sets the calling thread's team size only; looked up at run time so that a
// libtorch without OpenMP needs nothing. ATen initialises a thread's count lazily, on its first
// parallel op, from the process's count, once per library holding a copy of its inline initialiser:
// both copies that a worker's ops reach (libtorch's, through get_num_threads, and ours) run first.
void single_threaded_ops() {
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
  using SetThreads = void (*)(int);
  static const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set) set(1);
}

SamplerOptions sampler_options(const LoaderOptions& o, const std::shared_ptr<const Dataset>& d) {
  SamplerOptions s{o.shuffle, o.drop_last, o.seed, o.rank, o.world_size};
  if (o.pack_row_len > 0) s.rank = 0, s.world_size = 1;  // the whole epoch's samples: the rows are split
  if (d->epoch_order_size() >= 0) {  // a dataset that orders its epochs itself (a mix of sources)
    s.order_size = d->epoch_order_size();
    s.order = [d, seed = o.seed, shuffle = o.shuffle](int64_t epoch) { return d->epoch_order(seed, epoch, shuffle); };
  }
  auto it = o.exclude.find(o.split);
  if (it != o.exclude.end()) {
    s.exclude = it->second;
    std::sort(s.exclude.begin(), s.exclude.end());
    s.exclude.erase(std::unique(s.exclude.begin(), s.exclude.end()), s.exclude.end());
  }
  return s;
}
}  // namespace

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, CollateFn collate, LoaderOptions options)
    : dataset_(std::move(dataset)),
      collate_(std::move(collate)),
      opt_(options),
      sampler_(dataset_->size(), sampler_options(options, dataset_)),
      impl_(std::make_unique<Impl>()) {
  if (opt_.batch_size < 1) throw std::invalid_argument("loader: batch_size must be >= 1");
  if (opt_.num_workers < 0) throw std::invalid_argument("loader: num_workers must be >= 0");
  if (opt_.prefetch_factor < 1) opt_.prefetch_factor = 1;
  if (opt_.pack_row_len > 0) {
    lengths_.resize(static_cast<size_t>(dataset_->size()));
    for (int64_t i = 0; i < dataset_->size(); ++i) {
      lengths_[i] = dataset_->sample_length(i);
      if (lengths_[i] < 0) throw std::invalid_argument("loader: packing needs a dataset that knows its samples' lengths");
      if (lengths_[i] < 1 || lengths_[i] > opt_.pack_row_len)
        throw DataError(fmt::format("sample {} ({}) has {} tokens; a packed row holds 1 to {}", i, dataset_->describe(i),
                                    lengths_[i], opt_.pack_row_len));
    }
  }
}

std::shared_ptr<const RowPlan> DataLoader::plan(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(impl_->plan_mu);
  auto& plans = impl_->plans;
  auto it = plans.find(epoch);
  if (it == plans.end()) {
    if (plans.size() >= 2) plans.erase(plans.begin()->first < epoch ? plans.begin() : std::prev(plans.end()));
    it = plans.emplace(epoch, std::make_shared<const RowPlan>(best_fit_rows(sampler_.indices(epoch), lengths_, opt_.pack_row_len,
                                                                            opt_.seed, epoch, opt_.shuffle)))
             .first;
  }
  return it->second;
}

namespace {
// The split of an epoch's rows over the ranks: the sampler's rule (a stride each, the tail padded by
// wrapping or dropped) over the rows in the plan's order.
DistributedSampler row_split(int64_t rows, const LoaderOptions& o) {
  SamplerOptions s;
  s.shuffle = false;
  s.drop_last = o.drop_last;
  s.seed = o.seed;
  s.rank = o.rank;
  s.world_size = o.world_size;
  return DistributedSampler(rows, s);
}
}  // namespace

std::vector<int64_t> DataLoader::units(int64_t epoch, int64_t offset) const {
  if (opt_.pack_row_len <= 0) return sampler_.indices(epoch, offset);
  return row_split(plan(epoch)->rows(), opt_).indices(epoch, offset);
}

int64_t DataLoader::num_units(int64_t epoch, int64_t offset) const {
  if (opt_.pack_row_len <= 0) return sampler_.num_samples(epoch, offset);
  return row_split(plan(epoch)->rows(), opt_).num_samples(epoch, offset);
}

std::vector<int64_t> DataLoader::samples_of(int64_t epoch, const std::vector<int64_t>& order, int64_t begin, int64_t end) const {
  if (opt_.pack_row_len <= 0) return {order.begin() + begin, order.begin() + end};
  const auto p = plan(epoch);
  std::vector<int64_t> out;
  for (int64_t k = begin; k < end; ++k)
    out.insert(out.end(), p->samples.begin() + p->row_begin[order[k]], p->samples.begin() + p->row_begin[order[k] + 1]);
  return out;
}

DataLoader::~DataLoader() { stop(); }

int64_t DataLoader::num_batches() const { return num_batches(impl_->epoch); }

void DataLoader::exclude_from(int64_t epoch, std::vector<int64_t> before) {
  settings_changed();
  auto o = sampler_options(opt_, dataset_);
  o.exclude_from_epoch = epoch;
  std::sort(before.begin(), before.end());
  o.exclude_before = std::move(before);
  sampler_ = DistributedSampler(dataset_->size(), o);
  std::lock_guard<std::mutex> lock(impl_->plan_mu);
  impl_->plans.clear();  // another exclusion: other plans
}

int64_t DataLoader::num_batches(int64_t epoch) const {
  return batches_in(num_units(epoch, epoch == impl_->epoch ? impl_->offset : 0));
}

int64_t DataLoader::batches_in(int64_t n) const {
  int64_t full = opt_.drop_last ? n / opt_.batch_size : (n + opt_.batch_size - 1) / opt_.batch_size;
  return opt_.limit_batches >= 0 ? std::min(full, opt_.limit_batches) : full;
}

Batch DataLoader::make_batch(int64_t epoch, int64_t batch_index) const {
  std::shared_ptr<const std::vector<int64_t>> order;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (epoch == impl_->epoch) order = impl_->order;
  }
  if (!order) order = std::make_shared<const std::vector<int64_t>>(units(epoch));
  return make_batch_from(epoch, *order, batch_index);
}

Batch DataLoader::make_batch_from(int64_t epoch, const std::vector<int64_t>& order, int64_t batch_index) const {
  int64_t begin = batch_index * opt_.batch_size;
  int64_t end = std::min<int64_t>(begin + opt_.batch_size, static_cast<int64_t>(order.size()));
  if (begin >= end) throw std::out_of_range("loader: batch index past the end of the epoch");
  const std::vector<int64_t> wanted = samples_of(epoch, order, begin, end);
  std::vector<Sample> samples;
  std::vector<int64_t> indices;
  samples.reserve(wanted.size());
  for (int64_t i : wanted) {
    at::Generator gen = sample_generator(opt_.seed, epoch, i);
    Sample s = dataset_->get(i, gen);
    // An empty sample is one a dataset skipped as bad (on_bad_sample: skip; it logged it): the batch
    // is one smaller. Which samples are bad depends only on the files, so batches stay exact.
    if (!s.empty()) samples.push_back(std::move(s)), indices.push_back(i);
  }
  if (samples.empty())
    throw DataError(fmt::format("batch {} of epoch {}: every one of its {} samples was bad and skipped", batch_index, epoch,
                                wanted.size()));
  Batch b = [&] {
    CollatePinScope pins(opt_.pin_memory);
    return collate_(samples);
  }();
  if (!b.meta.count("batch_size")) b.meta["batch_size"] = static_cast<int64_t>(wanted.size());
  if (opt_.pack_row_len > 0) b.meta[kMetaRows] = end - begin;
  b.indices = std::move(indices);
  b.meta[kMetaBatchIndex] = batch_index;
  b.meta[kMetaEpoch] = epoch;
  return opt_.pin_memory ? b.pin_memory() : b;
}

Batch DataLoader::make_first_samples(int64_t epoch, int64_t count) const {
  // Under packing, the first `count` rows' samples.
  const std::vector<int64_t> units_now = units(epoch);
  const std::vector<int64_t> order =
      opt_.pack_row_len > 0 ? samples_of(epoch, units_now, 0, std::min<int64_t>(count, static_cast<int64_t>(units_now.size())))
                            : units_now;
  if (opt_.pack_row_len > 0) count = static_cast<int64_t>(order.size());
  std::vector<Sample> samples;
  std::vector<int64_t> indices;
  for (int64_t k = 0; k < static_cast<int64_t>(order.size()) && static_cast<int64_t>(samples.size()) < count; ++k) {
    at::Generator gen = sample_generator(opt_.seed, epoch, order[k]);
    Sample s = dataset_->get(order[k], gen);
    if (!s.empty()) samples.push_back(std::move(s)), indices.push_back(order[k]);
  }
  if (samples.empty()) throw DataError(fmt::format("epoch {}: no sample to make a batch of", epoch));
  const int64_t n = static_cast<int64_t>(samples.size());
  Batch b = collate_(samples);
  if (!b.meta.count("batch_size")) b.meta["batch_size"] = n;
  b.indices = std::move(indices);
  b.meta[kMetaBatchIndex] = 0;
  b.meta[kMetaEpoch] = epoch;
  return b;
}

void DataLoader::start(int64_t epoch, int64_t first_batch, int64_t sample_offset) {
  Impl& m = *impl_;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    if (!m.workers.empty() && !m.stopping && m.ahead.order && m.ahead.epoch == epoch && epoch == m.epoch + 1 && first_batch == 0 &&
        sample_offset == 0) {
      // The workers are already on this epoch: take over what they made (made exactly as below).
      m.epoch = epoch;
      m.offset = 0;
      m.order = std::move(m.ahead.order);
      m.end = m.ahead.end;
      m.next_to_make = m.ahead.next_to_make;
      m.next_to_yield = 0;
      m.ready = std::move(m.ahead.ready);
      m.error = m.ahead.error;
      m.error_index = m.ahead.error_index;
      m.ahead = Impl::Ahead{};
      lock.unlock();
      m.cv_space.notify_all();
      m.cv_made.notify_all();
      return;
    }
  }
  stop();
  auto order = std::make_shared<const std::vector<int64_t>>(units(epoch, sample_offset));
  std::unique_lock<std::mutex> lock(m.mu);
  m.epoch = epoch;
  m.offset = sample_offset;
  m.order = std::move(order);
  m.end = num_batches();
  m.next_to_make = m.next_to_yield = std::min(first_batch, m.end);
  m.ready.clear();
  m.error = nullptr;
  m.error_index = -1;
  m.ahead = Impl::Ahead{};
  m.stopping = false;
  ++m.generation;
  for (int64_t w = 0; w < opt_.num_workers; ++w) m.workers.emplace_back(&Impl::worker_loop, &m, std::cref(*this), m.generation);
}

bool collate_pins() { return collate_pins_now; }

void DataLoader::Impl::worker_loop(const DataLoader& loader, uint64_t gen) {
  single_threaded_ops();
  // Workers make batches in index order; the bound keeps at most num_workers * prefetch_factor
  // batches (this epoch's and, ahead, the next one's) made or being made and not yet taken.
  const int64_t capacity = loader.opt_.num_workers * loader.opt_.prefetch_factor;
  const bool look = loader.opt_.lookahead;
  for (;;) {
    int64_t e = 0, index = 0;
    std::shared_ptr<const std::vector<int64_t>> ord;
    {
      std::unique_lock<std::mutex> lock(mu);
      auto current = [&] { return next_to_make < end && next_to_make - next_to_yield < capacity; };
      auto can_ahead = [&] {
        return look && next_to_make >= end && !ahead.planning && !ahead.error && (ahead.epoch < 0 || ahead.next_to_make < ahead.end) &&
               (end - next_to_yield) + ahead.next_to_make < capacity;
      };
      cv_space.wait(lock, [&] {
        return stopping || gen != generation || error || current() || (!look && next_to_make >= end) || can_ahead();
      });
      if (stopping || gen != generation || error) return;
      if (current()) {
        e = epoch, ord = order, index = next_to_make++;
      } else if (!look) {
        return;  // every batch of the epoch is made or being made
      } else if (ahead.epoch < 0) {
        // Plan the next epoch (its units; under packing its rows) outside the lock; the others wait.
        ahead.planning = true;
        const int64_t next_epoch = epoch + 1;
        lock.unlock();
        std::shared_ptr<const std::vector<int64_t>> o;
        try {
          o = std::make_shared<const std::vector<int64_t>>(loader.units(next_epoch));
        } catch (...) {
          o = nullptr;  // start(next_epoch) will plan it again and raise what failed there
        }
        lock.lock();
        ahead.planning = false;
        if (gen == generation && !stopping && epoch + 1 == next_epoch && ahead.epoch < 0) {
          ahead.epoch = next_epoch;
          ahead.order = o;
          ahead.end = o ? loader.batches_in(static_cast<int64_t>(o->size())) : 0;
        }
        lock.unlock();
        cv_space.notify_all();
        continue;
      } else {
        e = ahead.epoch, ord = ahead.order, index = ahead.next_to_make++;
      }
    }
    try {
      Batch b = loader.make_batch_from(e, *ord, index);
      std::lock_guard<std::mutex> lock(mu);
      if (gen != generation) return;
      if (e == epoch && ord == order) {
        ready.emplace(index, std::move(b));  // this epoch's (an adopted lookahead's included)
      } else if (e == ahead.epoch && ord == ahead.order) {
        ahead.ready.emplace(index, std::move(b));
      }  // else another epoch was started: dropped
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (gen != generation) return;
      if (e == epoch && ord == order) {
        if (!error || index < error_index) error = std::current_exception(), error_index = index;
      } else if (e == ahead.epoch && ord == ahead.order) {
        if (!ahead.error || index < ahead.error_index) ahead.error = std::current_exception(), ahead.error_index = index;
      }
    }
    cv_made.notify_all();
  }
}

std::optional<Batch> DataLoader::next() {
  Impl& m = *impl_;
  if (opt_.num_workers == 0) {
    if (m.next_to_yield >= m.end) return std::nullopt;
    return make_batch(m.epoch, m.next_to_yield++);
  }
  std::unique_lock<std::mutex> lock(m.mu);
  if (m.next_to_yield >= m.end) return std::nullopt;
  m.cv_made.wait(lock, [&] { return (m.error && m.error_index <= m.next_to_yield) || m.ready.count(m.next_to_yield) > 0; });
  if (m.error && m.error_index <= m.next_to_yield) {
    auto e = m.error;
    lock.unlock();
    stop();
    std::rethrow_exception(e);
  }
  auto it = m.ready.find(m.next_to_yield);
  Batch b = std::move(it->second);
  m.ready.erase(it);
  ++m.next_to_yield;
  lock.unlock();
  m.cv_space.notify_all();
  return b;
}

void DataLoader::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stopping = true;
  }
  m.cv_space.notify_all();
  m.cv_made.notify_all();
  for (auto& t : m.workers) t.join();
  m.workers.clear();
  std::lock_guard<std::mutex> lock(m.mu);
  m.ready.clear();
  m.ahead = Impl::Ahead{};
}

void DataLoader::settings_changed() { stop(); }

}  // namespace strobe::data

namespace strobe::data {
void DataLoader::set_shuffle(bool shuffle) {
  settings_changed();
  opt_.shuffle = shuffle;
  sampler_ = DistributedSampler(dataset_->size(), sampler_options(opt_, dataset_));
  std::lock_guard<std::mutex> lock(impl_->plan_mu);
  impl_->plans.clear();
}
}  // namespace strobe::data
