// Small blocking-socket helpers on loopback for the emulator's tests and benchmarks: listen on a
// free port, connect with TCP_NODELAY, write all, read exactly. Errors abort nothing: they return
// false or -1 and leave errno set.
#pragma once

#include <cstddef>
#include <cstdint>

namespace geotrain::netem {

// Listens on 127.0.0.1 (port 0 = any free one); stores the bound port. Returns the fd or -1.
int ListenLoopback(int port, int* bound_port);
// Accepts one connection (TCP_NODELAY set); -1 on error.
int AcceptOne(int listen_fd);
// Connects to 127.0.0.1:port with TCP_NODELAY; -1 on error.
int ConnectLoopback(int port);
bool WriteAll(int fd, const void* data, size_t size);
// Reads exactly `size` bytes; false on error or end of stream.
bool ReadExact(int fd, void* data, size_t size);
// Waits up to timeout_ms for the fd to become readable (data, end of stream or error).
bool WaitReadable(int fd, int timeout_ms);
void CloseFd(int fd);
// Monotonic nanoseconds (steady_clock).
int64_t NowNanos();
// Sends `bytes` from `from` (on a writer thread, in `write_block`-byte writes) and reads them at `to`;
// returns the receiver's rate in bytes/s from its first read to its last, leaving out the first read
// (a token bucket's burst). `received` (optional) gets how many bytes arrived.
double ReceiverRate(int from, int to, int64_t bytes, size_t write_block, int64_t* received = nullptr);

}  // namespace geotrain::netem
