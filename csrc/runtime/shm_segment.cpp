#include "runtime/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "runtime/channel.h"

namespace pipeline_ext::shm {

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void ring_doorbell(SegmentHeader* h) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futex(&h->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

std::string errno_text() { return std::strerror(errno); }

void Mapping::unmap() {
  if (base) munmap(base, bytes);
  base = nullptr;
}

OwnSegment create_segment(int rank, int size, int64_t ring_bytes) {
  OwnSegment s;
  // An anonymous file (memfd): it has no name anywhere, so it cannot outlive its last user, whatever
  // the exit (SIGKILL included). Peers reach it through /proc/<pid>/fd while this rank lives.
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "pipeline_ext_shm", MFD_CLOEXEC));
  if (fd < 0) throw ChannelError("shared-memory transport: cannot create an inbox (memfd_create): " + errno_text());
  s.fd = fd;
  s.name = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
  const size_t bytes = Mapping::total_bytes(size, ring_bytes);
  // Allocated now (not sparse): no room is an error here, not a SIGBUS in a later write.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    close(fd);
    throw ChannelError("shared-memory transport: cannot allocate " + std::to_string(bytes) + " bytes of shared "
                       "memory for an inbox: " + std::strerror(err) + " (set PIPELINE_EXT_TRANSPORT=gloo, or a smaller "
                       "PIPELINE_EXT_SHM_RING_BYTES)");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const std::string why = errno_text();
    close(fd);
    throw ChannelError("shared-memory transport: cannot map the inbox: " + why);
  }
  s.map.base = base;
  s.map.bytes = bytes;
  auto* h = new (base) SegmentHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = static_cast<uint32_t>(size);
  h->owner_rank = rank;
  h->owner_pid = getpid();
  h->ring_bytes = ring_bytes;
  for (int p = 0; p < size; ++p) new (s.map.ring(p)) RingControl();
  return s;
}

Mapping open_segment(int peer, int size, int64_t ring_bytes, const std::string& name) {
  const int fd = open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    throw ChannelError("shared-memory transport: cannot open rank " + std::to_string(peer) + "'s inbox " + name +
                       ": " + errno_text() + " (has that rank exited? is it on this host, in this pid namespace?)");
  }
  struct stat st {};
  const bool ok = fstat(fd, &st) == 0;
  const size_t bytes = Mapping::total_bytes(size, ring_bytes);
  void* base = ok && static_cast<size_t>(st.st_size) == bytes
                   ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  close(fd);
  if (base == MAP_FAILED) {
    throw ChannelError("shared-memory transport: rank " + std::to_string(peer) + "'s segment " + name +
                       " cannot be mapped or has another size (ranks must agree on the ring size)");
  }
  Mapping m{base, bytes};
  auto* h = m.header();
  if (h->magic != kMagic || h->version != kVersion || h->nranks != static_cast<uint32_t>(size) ||
      h->owner_rank != peer || h->ring_bytes != ring_bytes) {
    m.unmap();
    throw ChannelError("shared-memory transport: " + name + " is not rank " + std::to_string(peer) +
                       "'s segment of this group (other version or ring size?)");
  }
  return m;
}

int open_pidfd(int64_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0)); }

bool process_alive(int pidfd, int64_t pid) {
  if (pidfd >= 0) {
    pollfd fd{pidfd, POLLIN, 0};
    return poll(&fd, 1, 0) == 0;
  }
  return !(kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
}

}  // namespace pipeline_ext::shm
