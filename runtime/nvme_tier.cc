#include "runtime/nvme_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

// Header-only: no xxHash library to link or to carry to the GPU machine.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/thread_pool.h"
#include "runtime/tsan.h"

namespace ps {
namespace {

constexpr char kSwapPrefix[] = "patrickstar-";
constexpr char kSwapSuffix[] = ".swap";
constexpr char kNewSuffix[] = ".new";  // a swap file before its owner locked it

// One asynchronous request, split into pieces; completes when the last piece does.
struct Request {
  IoOp op;
  std::string path;
  NvmeTier::IoCallback done;
  std::shared_ptr<IoChecksums> checksums;  // null: not verified (Note [NVMe checksums])
  std::atomic<int64_t> pieces_left{0};
  absl::Mutex mutex;
  absl::Status status ABSL_GUARDED_BY(mutex);
};

struct Piece {
  std::shared_ptr<Request> request;
  char* buffer = nullptr;
  int64_t offset = 0;  // file offset
  int64_t bytes = 0;
  int64_t done_bytes = 0;
  uint64_t hash = 0;  // a write's, taken at submission (Note [NVMe checksums])
  const IoFaultInjector* injector = nullptr;  // tests only
  IoFault fault;  // from the injector, applied in place of the real result
};

// Asks the injector (if any) what to make of this piece; called once, where the IO would start.
void ConsultInjector(Piece* piece) {
  if (piece->injector == nullptr || !*piece->injector) return;
  piece->fault = (*piece->injector)(piece->request->op, piece->offset, piece->bytes);
  piece->injector = nullptr;
}

absl::string_view OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

absl::Status PieceError(const Piece& piece, int error) {
  return ErrnoToStatus(
      error, absl::StrCat(OpName(piece.request->op), " of ", piece.bytes, " bytes at offset ",
                          piece.offset, " in file ", piece.request->path, " failed"));
}

absl::Status ShortTransferError(const Piece& piece) {
  return absl::DataLossError(
      absl::StrCat("short ", OpName(piece.request->op), ": ", piece.done_bytes, " of ", piece.bytes,
                   " bytes at offset ", piece.offset, " in file ", piece.request->path));
}

void FinishPiece(Piece* piece, absl::Status status) {
  std::shared_ptr<Request> request = std::move(piece->request);
  if (status.ok() && request->checksums != nullptr) {  // Note [NVMe checksums]
    if (request->op == IoOp::kWrite) {
      request->checksums->Record(piece->offset, piece->bytes, piece->hash);
    } else {
      status = request->checksums->Verify(piece->offset, piece->bytes,
                                          IoChecksums::Hash(piece->buffer, piece->bytes),
                                          request->path);
    }
  }
  delete piece;
  if (!status.ok()) {
    absl::MutexLock lock(&request->mutex);
    if (request->status.ok()) request->status = std::move(status);
  }
  if (request->pieces_left.fetch_sub(1) == 1) {
    absl::Status final_status;
    {
      absl::MutexLock lock(&request->mutex);
      final_status = request->status;
    }
    request->done(std::move(final_status));
  }
}

// Accounts `result` (bytes moved or -errno) to the piece. Returns true when the piece is
// finished (then it has been deleted), false when the remainder must be submitted again.
bool AccountResult(Piece* piece, int64_t result) {
  if (result < 0) {
    FinishPiece(piece, PieceError(*piece, static_cast<int>(-result)));
    return true;
  }
  piece->done_bytes += result;
  if (piece->done_bytes >= piece->bytes) {
    FinishPiece(piece, absl::OkStatus());
    return true;
  }
  if (result == 0) {
    FinishPiece(piece, ShortTransferError(*piece));
    return true;
  }
  return false;
}

}  // namespace

uint64_t IoChecksums::Hash(const void* data, int64_t bytes) {
  return XXH3_64bits(data, static_cast<size_t>(bytes));
}

void IoChecksums::Record(int64_t offset, int64_t bytes, uint64_t hash) {
  absl::MutexLock lock(&mutex_);
  written_[offset] = Written{bytes, hash};
}

absl::Status IoChecksums::Verify(int64_t offset, int64_t bytes, uint64_t hash,
                                 absl::string_view path) const {
  absl::MutexLock lock(&mutex_);
  auto it = written_.find(offset);
  if (it == written_.end() || it->second.bytes != bytes) return absl::OkStatus();
  ++verified_;
  if (it->second.hash == hash) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "checksum mismatch: the ", bytes, " bytes read at offset ", offset, " in file ", path,
      " are not the bytes written there (xxh3 ", absl::Hex(it->second.hash, absl::kZeroPad16),
      " written, ", absl::Hex(hash, absl::kZeroPad16),
      " read): the disk or filesystem changed them, or another process wrote to this swap "
      "file (memory.nvme.verify)"));
}

void IoChecksums::Forget(int64_t base, int64_t bytes) {
  absl::MutexLock lock(&mutex_);
  written_.erase(written_.lower_bound(base), written_.lower_bound(base + bytes));
}

int64_t IoChecksums::verified() const {
  absl::MutexLock lock(&mutex_);
  return verified_;
}

class NvmeTier::IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual void Submit(std::vector<Piece*> pieces) = 0;
  virtual bool is_io_uring() const = 0;
};

namespace {

// Applies an injected fault instead of real IO; returns the result to account, or nullopt when
// the piece should really run.
std::optional<int64_t> InjectedResult(Piece* piece) {
  if (piece->fault.error != 0) return -static_cast<int64_t>(piece->fault.error);
  if (piece->fault.transferred >= 0) {
    // Only the first pass reports the short count; afterwards the piece makes no progress.
    const int64_t moved = std::max<int64_t>(0, piece->fault.transferred - piece->done_bytes);
    piece->fault.transferred = piece->done_bytes;  // next pass moves 0
    return std::min(moved, piece->bytes - piece->done_bytes);
  }
  return std::nullopt;
}

class PosixBackend final : public NvmeTier::IoBackend {
 public:
  PosixBackend(int fd, int threads) : fd_(fd), pool_(threads, "ps-nvme-io") {}
  bool is_io_uring() const override { return false; }

  void Submit(std::vector<Piece*> pieces) override {
    for (Piece* piece : pieces) pool_.Schedule([this, piece] { Run(piece); });
  }

 private:
  void Run(Piece* piece) {
    ConsultInjector(piece);
    while (true) {
      int64_t result;
      if (std::optional<int64_t> injected = InjectedResult(piece)) {
        result = *injected;
      } else {
        char* buffer = piece->buffer + piece->done_bytes;
        const int64_t offset = piece->offset + piece->done_bytes;
        const size_t length = piece->bytes - piece->done_bytes;
        const ssize_t moved = piece->request->op == IoOp::kRead
                                  ? pread(fd_, buffer, length, offset)
                                  : pwrite(fd_, buffer, length, offset);
        if (moved < 0 && errno == EINTR) continue;
        result = moved < 0 ? -errno : moved;
      }
      if (AccountResult(piece, result)) return;
    }
  }

  int fd_;
  ThreadPool pool_;
};

class UringBackend final : public NvmeTier::IoBackend {
 public:
  static absl::StatusOr<std::unique_ptr<UringBackend>> Create(int fd, int queue_depth) {
    auto backend = std::unique_ptr<UringBackend>(new UringBackend(fd, queue_depth));
    const int error = io_uring_queue_init(queue_depth, &backend->ring_, 0);
    if (error < 0) return ErrnoToStatus(-error, "io_uring_queue_init");
    backend->initialized_ = true;
    backend->reaper_ = std::thread([b = backend.get()] { b->ReapLoop(); });
    return backend;
  }

  ~UringBackend() override {
    if (!initialized_) return;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(
          +[](UringBackend* b)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return b->pending_.empty() && b->in_flight_ == 0; },
          this));
      // A NOP without user data tells the reaper to stop.
      io_uring_sqe* sqe = GetSqeLocked();
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);
      io_uring_submit(&ring_);
    }
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  bool is_io_uring() const override { return true; }

  void Submit(std::vector<Piece*> pieces) override {
    absl::MutexLock lock(&mutex_);
    for (Piece* piece : pieces) pending_.push_back(piece);
    FlushLocked();
  }

 private:
  UringBackend(int fd, int queue_depth) : fd_(fd), queue_depth_(queue_depth) {}

  io_uring_sqe* GetSqeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // the ring is full of unsubmitted entries: push them out
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  // Note [io_uring threading]: submissions happen under mutex_ on any thread; completions are
  // reaped by the single reaper thread without the lock. liburing allows one submitter and one
  // reaper concurrently, and io_uring_wait_cqe never touches the submission queue.
  void FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    int prepared = 0;
    while (!pending_.empty() && in_flight_ < queue_depth_) {
      Piece* piece = pending_.front();
      pending_.pop_front();
      io_uring_sqe* sqe = GetSqeLocked();
      ConsultInjector(piece);
      const bool injected = piece->fault.error != 0 || piece->fault.transferred >= 0;
      if (injected) {
        io_uring_prep_nop(sqe);  // the fault is applied when the NOP completes
      } else if (piece->request->op == IoOp::kRead) {
        io_uring_prep_read(sqe, fd_, piece->buffer + piece->done_bytes,
                           piece->bytes - piece->done_bytes, piece->offset + piece->done_bytes);
      } else {
        io_uring_prep_write(sqe, fd_, piece->buffer + piece->done_bytes,
                            piece->bytes - piece->done_bytes, piece->offset + piece->done_bytes);
      }
      io_uring_sqe_set_data(sqe, piece);
      PS_TSAN_RELEASE(piece);  // Note [Happens-before through the kernel]
      ++in_flight_;
      ++prepared;
    }
    if (prepared > 0) {
      int submitted = io_uring_submit(&ring_);
      while (submitted == -EINTR || submitted == -EAGAIN) submitted = io_uring_submit(&ring_);
      PS_CHECK(submitted >= 0, "io_uring_submit failed: ", std::strerror(-submitted));
    }
  }

  void ReapLoop() {
    while (true) {
      io_uring_cqe* cqe = nullptr;
      const int error = io_uring_wait_cqe(&ring_, &cqe);
      if (error == -EINTR) continue;
      PS_CHECK(error == 0, "io_uring_wait_cqe failed: ", std::strerror(-error));
      Piece* piece = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
      int64_t result = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (piece == nullptr) return;
      PS_TSAN_ACQUIRE(piece);
      if (std::optional<int64_t> injected = InjectedResult(piece)) result = *injected;
      // EINTR/EAGAIN are transient: the same remainder is submitted again.
      const bool finished = result != -EINTR && result != -EAGAIN && AccountResult(piece, result);
      absl::MutexLock lock(&mutex_);
      --in_flight_;
      if (!finished) pending_.push_front(piece);
      FlushLocked();
    }
  }

  const int fd_;
  const int queue_depth_;
  bool initialized_ = false;
  io_uring ring_{};
  std::thread reaper_;
  absl::Mutex mutex_;
  std::deque<Piece*> pending_ ABSL_GUARDED_BY(mutex_);
  int in_flight_ ABSL_GUARDED_BY(mutex_) = 0;
};

// 64 random bits as hex: unique per process instance (Note [Swap file ownership]).
std::string RandomToken() {
  uint64_t value = 0;
  char* out = reinterpret_cast<char*>(&value);
  size_t filled = 0;
  while (filled < sizeof(value)) {
    const ssize_t got = getrandom(out + filled, sizeof(value) - filled, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {  // no getrandom (very old kernel): time and address still differ per run
      value ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
               reinterpret_cast<uintptr_t>(&value);
      break;
    }
    filled += static_cast<size_t>(got);
  }
  return absl::StrCat(absl::Hex(value, absl::kZeroPad16));
}

// Creates `<directory>/patrickstar-<pid>-<token>.swap`, already locked by the returned fd
// (Note [Swap file ownership]). Sets *path and *direct.
absl::StatusOr<int> CreateLockedSwapFile(const std::string& directory, bool* direct,
                                         std::string* note, std::string* path) {
  const int base_flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  for (int attempt = 0;; ++attempt) {
    *path = absl::StrCat(directory, "/", kSwapPrefix, getpid(), "-", RandomToken(), kSwapSuffix);
    const std::string fresh = absl::StrCat(*path, kNewSuffix);
    int fd = open(fresh.c_str(), base_flags | (*direct ? O_DIRECT : 0), 0600);
    if (fd < 0 && *direct && errno == EINVAL) {
      *note = absl::StrCat("O_DIRECT refused by the filesystem of ", directory,
                           " (tmpfs?); using buffered IO");
      *direct = false;
      fd = open(fresh.c_str(), base_flags, 0600);
    }
    if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("nvme tier: creating file '", fresh, "'"));
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (rename(fresh.c_str(), path->c_str()) == 0) return fd;
      if (errno != ENOENT) {
        const int error = errno;
        unlink(fresh.c_str());
        close(fd);
        return ErrnoToStatus(error, absl::StrCat("nvme tier: renaming '", fresh, "'"));
      }
    } else if (errno != EWOULDBLOCK) {
      const int error = errno;
      unlink(fresh.c_str());
      close(fd);
      return ErrnoToStatus(error, absl::StrCat("nvme tier: locking '", fresh, "'"));
    }
    // Another process's start-up cleanup took the file between open and lock; it unlinks it.
    close(fd);
    if (attempt == 100) {
      return absl::UnavailableError(absl::StrCat(
          "nvme tier: could not create a swap file in '", directory,
          "': other processes kept removing it"));
    }
  }
}

}  // namespace

std::vector<std::string> RemoveStaleSwapFiles(const std::string& directory) {
  std::vector<std::string> removed;
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return removed;
  while (dirent* entry = readdir(dir)) {
    absl::string_view name(entry->d_name);
    absl::ConsumeSuffix(&name, kNewSuffix);
    if (!absl::StartsWith(name, kSwapPrefix) || !absl::EndsWith(name, kSwapSuffix)) continue;
    const std::string path = absl::StrCat(directory, "/", entry->d_name);
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;  // gone already, or not ours to open
    struct stat info;
    // A lock held by anyone means a live owner, whatever its pid namespace.
    if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        unlink(path.c_str()) == 0) {
      PS_LOG(kWarning,
             "removed stale NVMe swap file %s (%d bytes): no running process holds it; a run "
             "that ended without cleaning up left it",
             path, static_cast<int64_t>(info.st_size));
      removed.push_back(path);
    }
    close(fd);
  }
  closedir(dir);
  return removed;
}

absl::StatusOr<std::unique_ptr<NvmeTier>> NvmeTier::Create(NvmeTierOptions options) {
  if (options.tier.name.empty()) options.tier.name = "nvme";
  if (options.directory.empty()) {
    return absl::InvalidArgumentError("nvme tier: no directory given (memory.nvme.path)");
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme tier: queue_depth must be in [1, 4096], got ", options.queue_depth));
  }
  if (options.io_block_bytes < kBlockAlignment || options.io_block_bytes % kBlockAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme tier: block_size must be a positive multiple of ", kBlockAlignment,
                     ", got ", options.io_block_bytes));
  }
  struct stat info;
  if (stat(options.directory.c_str(), &info) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("nvme tier: directory '", options.directory, "'"));
  }
  if (!S_ISDIR(info.st_mode)) {
    return ErrnoToStatus(ENOTDIR, absl::StrCat("nvme tier: '", options.directory, "'"));
  }
  RemoveStaleSwapFiles(options.directory);

  std::string note;
  std::string path;
  bool direct = options.use_direct_io;
  PS_ASSIGN_OR_RETURN(const int fd, CreateLockedSwapFile(options.directory, &direct, &note, &path));

  if (options.tier.budget_bytes == 0) {
    struct statvfs fs;
    if (fstatvfs(fd, &fs) == 0) {
      options.tier.budget_bytes = static_cast<int64_t>(fs.f_bavail) *
                                  static_cast<int64_t>(fs.f_frsize) / kBlockAlignment *
                                  kBlockAlignment;
    }
  }
  auto tier = std::unique_ptr<NvmeTier>(new NvmeTier(std::move(options), fd, path, direct));
  tier->fallback_note_ = note;

  if (tier->nvme_options_.use_io_uring) {
    absl::StatusOr<std::unique_ptr<UringBackend>> uring =
        UringBackend::Create(fd, tier->nvme_options_.queue_depth);
    if (uring.ok()) {
      tier->backend_ = *std::move(uring);
    } else {
      absl::StrAppend(&tier->fallback_note_, tier->fallback_note_.empty() ? "" : "; ",
                      "io_uring unavailable (", uring.status().message(),
                      "); using pread/pwrite threads");
    }
  } else {
    absl::StrAppend(&tier->fallback_note_, tier->fallback_note_.empty() ? "" : "; ",
                    "io_uring disabled by configuration; using pread/pwrite threads");
  }
  if (tier->backend_ == nullptr) {
    tier->backend_ =
        std::make_unique<PosixBackend>(fd, std::clamp(tier->nvme_options_.queue_depth, 1, 8));
  }
  if (!tier->fallback_note_.empty()) {
    PS_LOG(kInfo, "nvme tier %s: %s", path, tier->fallback_note_);
  }
  return tier;
}

NvmeTier::NvmeTier(NvmeTierOptions options, int fd, std::string path, bool direct_io)
    : Tier(TierKind::kNvme, AddressSpace::kFile, options.tier, /*blocks_start_valid=*/false),
      nvme_options_(std::move(options)),
      creator_pid_(getpid()),
      fd_(fd),
      path_(std::move(path)),
      direct_io_(direct_io),
      checksums_(nvme_options_.verify_checksums ? std::make_shared<IoChecksums>() : nullptr) {}

bool NvmeTier::InCreatorProcess() const { return getpid() == creator_pid_; }

NvmeTier::~NvmeTier() {
  const bool owner = InCreatorProcess();
  if (owner) {
    backend_.reset();  // drains IO in flight
    ReleaseAllRegions();
  } else {
    // Note [Swap files across fork]: the ring, the IO threads and the file's contents are the
    // parent's. Note [Tier teardown in a forked child]: no lock, no log line.
    static_cast<void>(backend_.release());
    ForgetAllRegionsInForkedChild();
  }
  // Unlink while the lock is still held (Note [Swap file ownership]). ENOENT: the directory
  // went first (a temporary directory removed before the process ended); nothing is left.
  if (owner && !path_.empty() && unlink(path_.c_str()) != 0 && errno != ENOENT) {
    PS_LOG(kWarning, "could not remove NVMe swap file %s: %s", path_, std::strerror(errno));
  }
  if (fd_ >= 0) close(fd_);
}

bool NvmeTier::uses_io_uring() const { return backend_ != nullptr && backend_->is_io_uring(); }

int64_t NvmeTier::file_bytes() const {
  struct stat info;
  return fstat(fd_, &info) == 0 ? info.st_size : -1;
}

absl::StatusOr<uint64_t> NvmeTier::ReserveRegion(int64_t bytes) {
  absl::MutexLock lock(&region_mutex_);
  for (auto it = released_ranges_.begin(); it != released_ranges_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first;
    if (it->second == bytes) {
      released_ranges_.erase(it);
    } else {
      it->first += bytes;
      it->second -= bytes;
    }
    if (fallocate(fd_, 0, offset, bytes) != 0) {
      released_ranges_.emplace_back(offset, bytes);
      return ErrnoToStatus(errno, absl::StrCat("preallocating ", bytes, " bytes at offset ", offset,
                                               " in file ", path_));
    }
    return offset;
  }
  const uint64_t offset = file_end_;
  if (fallocate(fd_, 0, offset, bytes) != 0) {
    const int error = errno;
    if (error != EOPNOTSUPP || ftruncate(fd_, offset + bytes) != 0) {
      return ErrnoToStatus(error, absl::StrCat("preallocating ", bytes, " bytes at offset ", offset,
                                               " in file ", path_));
    }
  }
  file_end_ += bytes;
  return offset;
}

void NvmeTier::ReleaseRegion(uint64_t base, int64_t bytes) {
  absl::MutexLock lock(&region_mutex_);
  // Give the disk space back; the range stays reusable. Not from a forked child: the file's
  // contents are the parent's chunks (Note [Swap files across fork]).
  if (InCreatorProcess()) {
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, base, bytes);
  }
  released_ranges_.emplace_back(base, bytes);
  if (checksums_ != nullptr) checksums_->Forget(static_cast<int64_t>(base), bytes);
}

absl::Status NvmeTier::CheckRange(const Block& block, const void* buffer, int64_t bytes,
                                  absl::string_view op) const {
  if (block.tier != this) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme tier '", name(), "': ", op, " of a block from another tier"));
  }
  if (bytes <= 0 || bytes > block.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("nvme tier '", name(), "': ", op, " of ", bytes,
                                                   " bytes does not fit block ", block.id, " of ",
                                                   block.bytes, " bytes"));
  }
  if (direct_io_ && (reinterpret_cast<uintptr_t>(buffer) % kBlockAlignment != 0 ||
                     bytes % kBlockAlignment != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme tier '", name(), "': O_DIRECT ", op, " needs a buffer address and length aligned to ",
        kBlockAlignment, " bytes, got address 0x", absl::Hex(reinterpret_cast<uintptr_t>(buffer)),
        " and length ", bytes, " (see Note [NVMe IO alignment])"));
  }
  return absl::OkStatus();
}

void NvmeTier::Submit(IoOp op, const Block& block, void* buffer, int64_t bytes, IoCallback done) {
  absl::Status range = CheckRange(block, buffer, bytes, OpName(op));
  if (!range.ok()) {
    done(range);
    return;
  }
  auto request = std::make_shared<Request>();
  request->op = op;
  request->path = path_;
  request->done = std::move(done);
  request->checksums = checksums_;
  const int64_t piece_bytes = nvme_options_.io_block_bytes;
  const int64_t count = (bytes + piece_bytes - 1) / piece_bytes;
  request->pieces_left.store(count);
  std::vector<Piece*> pieces;
  pieces.reserve(count);
  for (int64_t start = 0; start < bytes; start += piece_bytes) {
    auto* piece = new Piece;
    piece->request = request;
    piece->buffer = static_cast<char*>(buffer) + start;
    piece->offset = static_cast<int64_t>(block.address) + start;
    piece->bytes = std::min(piece_bytes, bytes - start);
    piece->injector = &nvme_options_.fault_injector;
    if (checksums_ != nullptr && op == IoOp::kWrite) {
      piece->hash = IoChecksums::Hash(piece->buffer, piece->bytes);
    }
    pieces.push_back(piece);
  }
  backend_->Submit(std::move(pieces));
}

void NvmeTier::SubmitWrite(const Block& block, const void* src, int64_t bytes, IoCallback done) {
  Submit(IoOp::kWrite, block, const_cast<void*>(src), bytes, std::move(done));
}

void NvmeTier::SubmitRead(const Block& block, void* dst, int64_t bytes, IoCallback done) {
  Submit(IoOp::kRead, block, dst, bytes, std::move(done));
}

absl::Status NvmeTier::TransferAndWait(IoOp op, const Block& block, void* buffer, int64_t bytes) {
  absl::Notification finished;
  absl::Status result;
  Submit(op, block, buffer, bytes, [&](absl::Status status) {
    result = std::move(status);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::Status NvmeTier::Write(const Block& block, const void* src, int64_t bytes) {
  PS_RETURN_IF_ERROR(BeginWrite(block));
  absl::Status status = TransferAndWait(IoOp::kWrite, block, const_cast<void*>(src), bytes);
  EndWrite(block, status.ok());
  return status;
}

absl::Status NvmeTier::Read(const Block& block, void* dst, int64_t bytes) {
  PS_ASSIGN_OR_RETURN(bool valid, IsValid(block));
  if (!valid) {
    return absl::FailedPreconditionError(absl::StrCat(
        "nvme tier '", name(), "': block ", block.id, " at offset ", block.address, " in file ",
        path_, " holds no complete data (never written, or its last write failed)"));
  }
  PS_RETURN_IF_ERROR(Pin(block));
  absl::Status status = TransferAndWait(IoOp::kRead, block, dst, bytes);
  Unpin(block);
  return status;
}

}  // namespace ps
