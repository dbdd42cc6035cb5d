// The WAN emulator's event loop: listeners, relayed connections and the control port.
// See emulator.h for the model and the threading; everything below runs on the loop thread unless a
// comment says otherwise.
#include "netem/emulator.h"

#include <algorithm>
#include <boost/asio.hpp>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "netem/delay_line.h"
#include "netem/strings.h"
#include "netem/token_bucket.h"

namespace geotrain::netem {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using ErrorCode = boost::system::error_code;

// Chunks of 2 ms of the link's rate, 4-64 KiB. 64 KiB beat 256 KiB on loopback (5-7 vs 2 Gbit/s
// through the relay): larger chunks leave the cache before they are written out.
constexpr int64_t kMaxChunkBytes = 64 * 1024;
constexpr int64_t kMinChunkBytes = 4 * 1024;
constexpr int64_t kMinBufferBytes = 64 * 1024;
constexpr int64_t kMaxBufferBytes = 64 * 1024 * 1024;
// Uncapped links have no bandwidth-delay product to size for; 16 MiB per connection direction
// allows 1.3 Gbit/s at 100 ms one way.
constexpr int64_t kUncappedBufferBytes = 16 * 1024 * 1024;
constexpr size_t kMaxChunksPerWrite = 16;
constexpr size_t kSpareBuffers = 4;  // per connection direction
constexpr size_t kMaxControlLine = 4096;

std::string LinkKey(std::string_view src, std::string_view dst) { return absl::StrCat(ToAbsl(src), ">", ToAbsl(dst)); }

// Resets a socket: the peer sees ECONNRESET rather than an orderly end of stream.
void ResetSocket(tcp::socket& socket) {
  ErrorCode ignored;
  if (!socket.is_open()) return;
  socket.set_option(asio::socket_base::linger(true, 0), ignored);
  socket.close(ignored);
}

// One direction of one link: its shaping, its state and its counters.
struct LinkDirection {
  LinkDirection(std::string s, std::string d, TimePoint now)
      : src(std::move(s)), dst(std::move(d)), bucket(0, 1, now) {}

  void Configure(const LinkParams& p, const EmulatorOptions& options, TimePoint now) {
    params = p;
    latency = MillisToDuration(p.latency_ms);
    jitter = MillisToDuration(p.jitter_ms);
    const double rate = p.bandwidth_mbps * 1e6 / 8;  // bytes per second; 0 is uncapped
    chunk_bytes = rate > 0 ? std::clamp<int64_t>(static_cast<int64_t>(rate * 0.002), kMinChunkBytes, kMaxChunkBytes)
                           : kMaxChunkBytes;
    // 10 ms of burst: when the loop thread is descheduled for a few ms on a busy machine, the
    // tokens it could not use are spent when it runs again, so the cap holds over longer windows
    // (2 ms of burst lost 3-8% of 100-1000 Mbit/s caps with the two cores busy).
    const int64_t burst = options.burst_bytes > 0 ? options.burst_bytes
                                                  : std::max<int64_t>(16 * 1024, static_cast<int64_t>(rate * 0.010));
    bucket.SetRate(rate, burst, now);
    if (options.max_buffer_bytes > 0) {
      max_buffer_bytes = std::max(options.max_buffer_bytes, chunk_bytes);
    } else if (rate > 0) {
      // Clamped as a double before the conversion: a fast, long link's product can exceed int64.
      const double delay_s = (p.latency_ms + p.jitter_ms) / 1000;
      const double wanted = 1.25 * rate * delay_s + static_cast<double>(bucket.burst_bytes() + 2 * chunk_bytes);
      max_buffer_bytes = static_cast<int64_t>(
          std::clamp(wanted, static_cast<double>(kMinBufferBytes), static_cast<double>(kMaxBufferBytes)));
    } else {
      max_buffer_bytes = kUncappedBufferBytes;
    }
  }

  std::string src;
  std::string dst;
  LinkParams params;
  Duration latency{};
  Duration jitter{};
  TokenBucket bucket;
  int64_t chunk_bytes = kMaxChunkBytes;
  int64_t max_buffer_bytes = kUncappedBufferBytes;
  bool up = true;
  TimePoint stalled_until{};
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
  // Measured: read-to-write time of recent chunks (an exponential average over about 20 chunks),
  // and the rate written over the last full second.
  double measured_delay_ms = 0;
  bool have_delay = false;
  double measured_mbps = 0;
  int64_t bytes_out_at_last_sample = 0;
  int64_t queued_bytes = 0;
  int64_t connections_total = 0;
  int64_t connections_active = 0;
  int64_t connections_reset = 0;
};

// One relayed TCP connection: the client's socket, the target's socket, and a pipe per direction.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  using RemoveFn = std::function<void(uint64_t)>;

  Connection(asio::io_context& io, uint64_t id, tcp::socket client, LinkDirection* forward, LinkDirection* backward,
             uint64_t seed, RemoveFn remove)
      : id_(id),
        client_(std::move(client)),
        server_(io),
        forward_(&client_, &server_, forward, seed * 2 + 1, io),
        backward_(&server_, &client_, backward, seed * 2 + 2, io),
        remove_(std::move(remove)) {}

  uint64_t id() const { return id_; }
  bool Uses(const LinkDirection* link) const { return forward_.link == link || backward_.link == link; }
  LinkDirection* forward_link() const { return forward_.link; }

  void Start(const tcp::endpoint& target) {
    forward_.link->connections_active++;
    server_.async_connect(target, [self = shared_from_this()](const ErrorCode& ec) {
      if (self->closed_) return;
      if (ec) {
        GT_LOG(WARNING) << "netem: connection " << self->id_ << " on " << self->forward_.link->src << ">"
                        << self->forward_.link->dst << ": target refused (" << ec.message()
                        << "); resetting the client";
        self->Close(/*reset=*/true);
        return;
      }
      ErrorCode ignored;
      self->client_.set_option(tcp::no_delay(true), ignored);
      self->server_.set_option(tcp::no_delay(true), ignored);
      self->Read(self->forward_);
      self->Read(self->backward_);
    });
  }

  // Closes both sockets (with a reset when `reset`), drops queued data and forgets the connection.
  void Close(bool reset) {
    if (closed_) return;
    closed_ = true;
    // Close the sockets first: that cancels a pending write, which must not see its buffers freed.
    ErrorCode ignored;
    if (reset) {
      ResetSocket(client_);
      ResetSocket(server_);
    } else {
      client_.close(ignored);
      server_.close(ignored);
    }
    for (Pipe* p : {&forward_, &backward_}) {
      p->link->queued_bytes -= p->queued;
      p->queued = 0;
      p->queue.clear();
      p->timer.cancel();
    }
    forward_.link->connections_active--;
    remove_(id_);
  }

  // Makes pipes waiting on a timer look at their queue again (a stall ended early).
  void Wake() {
    for (Pipe* p : {&forward_, &backward_}) {
      if (p->waiting) p->timer.cancel();
    }
  }

 private:
  // Buffers are not zero-filled (read() fills them) and are reused, a few per connection direction,
  // so that a steady stream allocates nothing.
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
  };
  struct Chunk {
    Buffer buffer;
    size_t size;
    TimePoint read_at;
    TimePoint release;
  };
  struct Pipe {
    Pipe(tcp::socket* f, tcp::socket* t, LinkDirection* l, uint64_t seed, asio::io_context& io)
        : from(f), to(t), link(l), delay(seed), timer(io) {}
    tcp::socket* from;
    tcp::socket* to;
    LinkDirection* link;
    DelayLine delay;
    asio::steady_timer timer;
    std::deque<Chunk> queue;
    Buffer reading_into;
    std::vector<Buffer> spare;
    int64_t queued = 0;
    bool reading = false;
    bool writing = false;
    bool waiting = false;
    bool eof = false;        // the source ended its stream
    bool shut_down = false;  // and we passed the end on
  };

  void Read(Pipe& p) {
    if (closed_ || p.reading || p.eof) return;
    // Back-pressure: while the pipe holds too much, leave the bytes in the source's socket so that
    // TCP flow control slows the sender down.
    if (p.queued > 0 && p.queued + p.link->chunk_bytes > p.link->max_buffer_bytes) return;
    p.reading = true;
    const auto capacity = static_cast<size_t>(p.link->chunk_bytes);
    if (p.reading_into.capacity != capacity) {
      p.reading_into = TakeBuffer(p, capacity);
    }
    p.from->async_read_some(asio::buffer(p.reading_into.data.get(), capacity),
                            [self = shared_from_this(), &p](const ErrorCode& ec, size_t n) { self->OnRead(p, ec, n); });
  }

  static Buffer TakeBuffer(Pipe& p, size_t capacity) {
    while (!p.spare.empty()) {
      Buffer b = std::move(p.spare.back());
      p.spare.pop_back();
      if (b.capacity == capacity) return b;
    }
    return Buffer{std::unique_ptr<char[]>(new char[capacity]), capacity};
  }

  void OnRead(Pipe& p, const ErrorCode& ec, size_t n) {
    p.reading = false;
    if (closed_) return;
    if (ec) {
      if (ec == asio::error::eof) {
        p.eof = true;
        Pump(p);
        return;
      }
      Close(/*reset=*/true);
      return;
    }
    LinkDirection& link = *p.link;
    const TimePoint now = SteadyClock::now();
    const TimePoint sent = link.bucket.Reserve(now, static_cast<int64_t>(n));
    const TimePoint release = p.delay.Release(sent, link.latency, link.jitter);
    p.queue.push_back(Chunk{std::move(p.reading_into), n, now, release});
    p.reading_into = Buffer{};
    p.queued += static_cast<int64_t>(n);
    link.queued_bytes += static_cast<int64_t>(n);
    link.bytes_in += static_cast<int64_t>(n);
    Pump(p);
    Read(p);
  }

  // Writes the chunks that are due, or waits for the first one.
  void Pump(Pipe& p) {
    if (closed_ || p.writing || p.waiting) return;
    if (p.queue.empty()) {
      if (p.eof && !p.shut_down) {
        p.shut_down = true;
        ErrorCode ignored;
        p.to->shutdown(tcp::socket::shutdown_send, ignored);
        if (forward_.shut_down && backward_.shut_down) Close(/*reset=*/false);
      }
      return;
    }
    const TimePoint now = SteadyClock::now();
    const TimePoint stalled_until = p.link->stalled_until;
    const TimePoint due = std::max(p.queue.front().release, stalled_until);
    if (due > now) {
      p.waiting = true;
      p.timer.expires_at(due);
      p.timer.async_wait([self = shared_from_this(), &p](const ErrorCode&) {
        p.waiting = false;
        self->Pump(p);
      });
      return;
    }
    std::vector<asio::const_buffer> buffers;
    int64_t bytes = 0;
    for (const Chunk& chunk : p.queue) {
      if (buffers.size() >= kMaxChunksPerWrite || std::max(chunk.release, stalled_until) > now) break;
      buffers.push_back(asio::buffer(chunk.buffer.data.get(), chunk.size));
      bytes += static_cast<int64_t>(chunk.size);
    }
    const size_t count = buffers.size();
    p.writing = true;
    asio::async_write(*p.to, buffers, [self = shared_from_this(), &p, count, bytes](const ErrorCode& ec, size_t) {
      self->OnWritten(p, count, bytes, ec);
    });
  }

  void OnWritten(Pipe& p, size_t count, int64_t bytes, const ErrorCode& ec) {
    p.writing = false;
    if (closed_) return;
    if (ec) {
      Close(/*reset=*/true);
      return;
    }
    const TimePoint now = SteadyClock::now();
    LinkDirection& link = *p.link;
    for (size_t i = 0; i < count; ++i) {
      const double delay_ms = DurationToMillis(now - p.queue.front().read_at);
      link.measured_delay_ms = link.have_delay ? 0.95 * link.measured_delay_ms + 0.05 * delay_ms : delay_ms;
      link.have_delay = true;
      if (p.spare.size() < kSpareBuffers) p.spare.push_back(std::move(p.queue.front().buffer));
      p.queue.pop_front();
    }
    p.queued -= bytes;
    p.link->queued_bytes -= bytes;
    p.link->bytes_out += bytes;
    Pump(p);
    Read(p);
  }

  uint64_t id_;
  tcp::socket client_;
  tcp::socket server_;
  Pipe forward_;   // client -> target, over link src>dst
  Pipe backward_;  // target -> client, over link dst>src
  RemoveFn remove_;
  bool closed_ = false;
};

}  // namespace

class Emulator::Impl {
 public:
  Impl(const Topology& topology, std::vector<RouteSpec> routes, EmulatorOptions options)
      : topology_(topology), options_(std::move(options)) {
    const TimePoint now = SteadyClock::now();
    for (const TopologyLink& link : topology_.links()) {
      LinkParams params{link.latency_ms(), link.bandwidth_mbps(), link.jitter_ms()};
      for (auto [src, dst] : {std::pair(link.a(), link.b()), std::pair(link.b(), link.a())}) {
        auto direction = std::make_unique<LinkDirection>(src, dst, now);
        direction->Configure(params, options_, now);
        links_[LinkKey(src, dst)] = std::move(direction);
      }
    }
    for (RouteSpec& route : routes) {
      auto listener = std::make_unique<Listener>(io_);
      listener->forward = links_.at(LinkKey(route.src_site, route.dst_site)).get();
      listener->backward = links_.at(LinkKey(route.dst_site, route.src_site)).get();
      listener->spec = std::move(route);
      listeners_.push_back(std::move(listener));
    }
  }

  ~Impl() { Stop(); }

  // Runs `fn` on the loop thread and returns its result; inline when already there or when the loop
  // is not running (before Start, after Stop).
  template <typename Fn>
  auto RunOnLoop(Fn fn) -> decltype(fn()) {
    if (!running_ || std::this_thread::get_id() == loop_thread_id_) return fn();
    std::packaged_task<decltype(fn())()> task(std::move(fn));
    auto result = task.get_future();
    asio::post(io_, [&task] { task(); });
    return result.get();
  }

  absl::Status Start() {
    if (started_) return absl::FailedPreconditionError("the emulator is already started");
    asio::ip::address listen_address;
    ErrorCode ec;
    listen_address = asio::ip::make_address(options_.listen_host, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("listen host '", options_.listen_host, "' is not an IP address; give one such as 127.0.0.1"));
    }
    tcp::resolver resolver(io_);
    for (auto& l : listeners_) {
      const std::string route = FormatRoute(l->spec);
      auto resolved = resolver.resolve(l->spec.target_host, std::to_string(l->spec.target_port), ec);
      if (ec || resolved.empty()) {
        CloseListeners();
        return absl::InvalidArgumentError(absl::StrCat("route ", route, ": cannot resolve target host '",
                                                       l->spec.target_host, "' (", ec.message(),
                                                       "); give an IP address or a name this machine resolves"));
      }
      l->target = resolved.begin()->endpoint();
      const tcp::endpoint endpoint(listen_address, static_cast<uint16_t>(l->spec.listen_port));
      l->acceptor.open(endpoint.protocol(), ec);
      if (!ec) l->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) l->acceptor.bind(endpoint, ec);
      if (!ec) l->acceptor.listen(asio::socket_base::max_listen_connections, ec);
      if (ec) {
        CloseListeners();
        const std::string where = absl::StrCat(options_.listen_host, ":", l->spec.listen_port);
        if (ec == asio::error::address_in_use) {
          return absl::AlreadyExistsError(absl::StrCat("route ", route, ": port ", where,
                                                       " is already in use; stop the process that holds it "
                                                       "(ss -ltnp 'sport = :",
                                                       l->spec.listen_port,
                                                       "') or give the route another listen "
                                                       "port (0 picks a free one)"));
        }
        return absl::InvalidArgumentError(
            absl::StrCat("route ", route, ": cannot listen on ", where, ": ", ec.message()));
      }
      l->bound_port = l->acceptor.local_endpoint().port();
    }
    for (auto& l : listeners_) Accept(l.get());
    SampleRates(SteadyClock::now());
    work_.emplace(io_.get_executor());
    started_ = true;
    running_ = true;
    std::promise<void> ready;
    thread_ = std::thread([this, &ready] {
      loop_thread_id_ = std::this_thread::get_id();
      ready.set_value();
      io_.run();
    });
    ready.get_future().wait();
    return absl::OkStatus();
  }

  void Stop() {
    if (!running_) return;
    asio::post(io_, [this] {
      CloseListeners();
      rate_timer_.cancel();
      ErrorCode ignored;
      if (control_) control_->close(ignored);
      for (auto& [id, session] : sessions_) session->close(ignored);
      sessions_.clear();
      std::vector<std::shared_ptr<Connection>> all;
      for (auto& [id, c] : connections_) all.push_back(c);
      for (auto& c : all) c->Close(/*reset=*/false);
      connections_.clear();
      work_.reset();
      io_.stop();
    });
    thread_.join();
    running_ = false;
  }

  absl::StatusOr<int> StartControlServer(int port) {
    if (!running_) return absl::FailedPreconditionError("start the emulator before its control port");
    return RunOnLoop([this, port]() -> absl::StatusOr<int> {
      if (control_) return absl::AlreadyExistsError("the control port is already open");
      auto acceptor = std::make_unique<tcp::acceptor>(io_);
      const tcp::endpoint endpoint(asio::ip::address_v4::loopback(), static_cast<uint16_t>(port));
      ErrorCode ec;
      acceptor->open(endpoint.protocol(), ec);
      if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) acceptor->bind(endpoint, ec);
      if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
      if (ec) {
        return absl::UnavailableError(
            absl::StrCat("control port 127.0.0.1:", port, ": ", ec.message(),
                         ec == asio::error::address_in_use
                             ? "; another process holds it: choose another --control-port (0 picks a free one)"
                             : ""));
      }
      control_ = std::move(acceptor);
      AcceptControl();
      return static_cast<int>(control_->local_endpoint().port());
    });
  }

  std::vector<RouteStatus> Routes() {
    return RunOnLoop([this] {
      std::vector<RouteStatus> routes;
      for (auto& l : listeners_) routes.push_back({l->spec, l->bound_port});
      return routes;
    });
  }

  std::vector<LinkDirectionStats> Stats() {
    return RunOnLoop([this] {
      const TimePoint now = SteadyClock::now();
      std::vector<LinkDirectionStats> stats;
      for (auto& [key, l] : links_) {
        LinkDirectionStats s;
        s.src = l->src;
        s.dst = l->dst;
        s.params = l->params;
        s.up = l->up;
        s.stalled_ms_left = l->stalled_until > now ? DurationToMillis(l->stalled_until - now) : 0;
        s.bytes_in = l->bytes_in;
        s.bytes_out = l->bytes_out;
        s.queued_bytes = l->queued_bytes;
        s.connections_total = l->connections_total;
        s.connections_active = l->connections_active;
        s.connections_reset = l->connections_reset;
        s.measured_delay_ms = l->measured_delay_ms;
        s.measured_mbps = l->measured_mbps;
        stats.push_back(std::move(s));
      }
      return stats;
    });
  }

  absl::Status SetLinkUp(std::string_view a, std::string_view b, bool up) {
    return RunOnLoop([&]() -> absl::Status {
      ASSIGN_OR_RETURN(auto pair, FindLink(a, b));
      for (LinkDirection* l : {pair.first, pair.second}) l->up = up;
      if (!up) {
        std::vector<std::shared_ptr<Connection>> hit;
        for (auto& [id, c] : connections_) {
          if (c->Uses(pair.first)) hit.push_back(c);
        }
        for (auto& c : hit) {
          c->forward_link()->connections_reset++;
          c->Close(/*reset=*/true);
        }
      }
      GT_LOG(INFO) << "netem: link " << a << "-" << b << (up ? " up" : " down");
      return absl::OkStatus();
    });
  }

  absl::Status Stall(std::string_view a, std::string_view b, Duration duration) {
    return RunOnLoop([&]() -> absl::Status {
      ASSIGN_OR_RETURN(auto pair, FindLink(a, b));
      const TimePoint until = SteadyClock::now() + std::max(duration, Duration::zero());
      for (LinkDirection* l : {pair.first, pair.second}) l->stalled_until = until;
      for (auto& [id, c] : connections_) {
        if (c->Uses(pair.first)) c->Wake();
      }
      return absl::OkStatus();
    });
  }

  absl::Status SetLinkParams(std::string_view src, std::string_view dst, const LinkParams& params, bool both) {
    RETURN_IF_ERROR(ValidateLinkFigures(absl::StrCat("netem: link ", ToAbsl(src), "-", ToAbsl(dst)), params.latency_ms,
                                        params.bandwidth_mbps, params.jitter_ms));
    return RunOnLoop([&]() -> absl::Status {
      ASSIGN_OR_RETURN(auto pair, FindLink(src, dst));
      const TimePoint now = SteadyClock::now();
      pair.first->Configure(params, options_, now);
      if (both) pair.second->Configure(params, options_, now);
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::string> ExecuteCommand(std::string_view line);

 private:
  struct Listener {
    explicit Listener(asio::io_context& io) : acceptor(io), retry(io) {}
    RouteSpec spec;
    tcp::acceptor acceptor;
    asio::steady_timer retry;
    tcp::endpoint target;
    LinkDirection* forward = nullptr;
    LinkDirection* backward = nullptr;
    int bound_port = 0;
  };

  // The two directions (src>dst, dst>src) of the link between two sites.
  absl::StatusOr<std::pair<LinkDirection*, LinkDirection*>> FindLink(std::string_view src, std::string_view dst) {
    auto forward = links_.find(LinkKey(src, dst));
    auto backward = links_.find(LinkKey(dst, src));
    if (forward == links_.end() || backward == links_.end()) {
      std::vector<std::string> known;
      for (const TopologyLink& l : topology_.links()) known.push_back(absl::StrCat(l.a(), " ", l.b()));
      return absl::NotFoundError(
          absl::StrCat("no link between '", ToAbsl(src), "' and '", ToAbsl(dst),
                       "' in the topology; links: ", known.empty() ? "none" : absl::StrJoin(known, ", ")));
    }
    return std::pair(forward->second.get(), backward->second.get());
  }

  // Once a second: the rate each link direction wrote over the last second.
  void SampleRates(TimePoint last) {
    rate_timer_.expires_after(std::chrono::seconds(1));
    rate_timer_.async_wait([this, last](const ErrorCode& ec) {
      if (ec) return;
      const TimePoint now = SteadyClock::now();
      const double seconds = std::chrono::duration<double>(now - last).count();
      for (auto& [key, l] : links_) {
        l->measured_mbps = (l->bytes_out - l->bytes_out_at_last_sample) * 8 / 1e6 / seconds;
        l->bytes_out_at_last_sample = l->bytes_out;
      }
      SampleRates(now);
    });
  }

  void CloseListeners() {
    ErrorCode ignored;
    for (auto& l : listeners_) {
      l->acceptor.close(ignored);
      l->retry.cancel();
    }
  }

  void Accept(Listener* l) {
    l->acceptor.async_accept([this, l](const ErrorCode& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !l->acceptor.is_open()) return;
      if (ec) {
        // Out of descriptors and the like: try again a little later rather than spin.
        GT_LOG(WARNING) << "netem: accept on port " << l->bound_port << ": " << ec.message();
        l->retry.expires_after(std::chrono::milliseconds(50));
        l->retry.async_wait([this, l](const ErrorCode& e) {
          if (!e) Accept(l);
        });
        return;
      }
      OnAccepted(l, std::move(socket));
      Accept(l);
    });
  }

  void OnAccepted(Listener* l, tcp::socket socket) {
    l->forward->connections_total++;
    if (!l->forward->up) {
      l->forward->connections_reset++;
      ResetSocket(socket);
      return;
    }
    const uint64_t id = next_connection_id_++;
    auto connection =
        std::make_shared<Connection>(io_, id, std::move(socket), l->forward, l->backward, options_.seed * 1000003 + id,
                                     [this](uint64_t gone) { connections_.erase(gone); });
    connections_[id] = connection;
    connection->Start(l->target);
  }

  void AcceptControl() {
    control_->async_accept([this](const ErrorCode& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !control_ || !control_->is_open()) return;
      if (!ec) {
        const uint64_t id = next_session_id_++;
        auto session = std::make_shared<tcp::socket>(std::move(socket));
        sessions_[id] = session;
        ReadControl(id, session, std::make_shared<asio::streambuf>(kMaxControlLine));
      }
      AcceptControl();
    });
  }

  void ReadControl(uint64_t id, std::shared_ptr<tcp::socket> socket, std::shared_ptr<asio::streambuf> buffer) {
    asio::async_read_until(*socket, *buffer, '\n', [this, id, socket, buffer](const ErrorCode& ec, size_t n) {
      if (ec) {  // end of session, or a line longer than kMaxControlLine
        ErrorCode ignored;
        socket->close(ignored);
        sessions_.erase(id);
        return;
      }
      std::string line(asio::buffers_begin(buffer->data()),
                       asio::buffers_begin(buffer->data()) + static_cast<std::ptrdiff_t>(n));
      buffer->consume(n);
      const absl::string_view command = absl::StripAsciiWhitespace(line);
      if (command == "quit" || command == "exit") {
        ErrorCode ignored;
        socket->close(ignored);
        sessions_.erase(id);
        return;
      }
      std::string reply;
      if (!command.empty()) {
        absl::StatusOr<std::string> out = ExecuteCommand(ToStd(command));
        if (out.ok()) {
          reply = *out;
          if (!reply.empty() && reply.back() != '\n') reply += '\n';
          reply += "ok\n";
        } else {
          reply = absl::StrCat("error: ", out.status().message(), "\n");
        }
      }
      auto text = std::make_shared<std::string>(std::move(reply));
      asio::async_write(*socket, asio::buffer(*text), [this, id, socket, buffer, text](const ErrorCode& e, size_t) {
        if (e) {
          sessions_.erase(id);
          return;
        }
        ReadControl(id, socket, buffer);
      });
    });
  }

  asio::io_context io_;
  asio::steady_timer rate_timer_{io_};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread thread_;
  std::thread::id loop_thread_id_;
  bool started_ = false;
  bool running_ = false;

  Topology topology_;
  EmulatorOptions options_;
  std::map<std::string, std::unique_ptr<LinkDirection>> links_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> connections_;
  uint64_t next_connection_id_ = 1;
  std::unique_ptr<tcp::acceptor> control_;
  std::map<uint64_t, std::shared_ptr<tcp::socket>> sessions_;
  uint64_t next_session_id_ = 1;
};

namespace {

constexpr char kHelp[] =
    "commands:\n"
    "  link down A B      reset the connections on link A-B and refuse new ones\n"
    "  link up A B        accept connections on link A-B again\n"
    "  stall A B MS       hold data on link A-B for MS milliseconds (0 ends a stall)\n"
    "  set A B [latency_ms=X] [bandwidth_mbps=Y] [jitter_ms=Z]   reshape both directions of A-B\n"
    "  stats [json]       bytes, queue and connections per link direction\n"
    "  routes             the routes and the ports they listen on\n"
    "  quit               end this control session\n";

bool ParseNonNegative(absl::string_view s, double* out) {
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !(v >= 0) || v > 1e9) return false;
  *out = v;
  return true;
}

}  // namespace

absl::StatusOr<std::string> Emulator::Impl::ExecuteCommand(std::string_view line) {
  std::vector<std::string> words =
      absl::StrSplit(absl::StripAsciiWhitespace(ToAbsl(line)), ' ', absl::SkipWhitespace());
  if (words.empty() || words[0] == "help") return std::string(kHelp);
  const std::string verb = words[0];
  if (verb == "link") {
    if (words.size() != 4 || (words[1] != "down" && words[1] != "up")) {
      return absl::InvalidArgumentError("usage: link down A B | link up A B");
    }
    RETURN_IF_ERROR(SetLinkUp(words[2], words[3], words[1] == "up"));
    return std::string();
  }
  if (verb == "stall") {
    double ms = 0;
    if (words.size() != 4 || !ParseNonNegative(words[3], &ms)) {
      return absl::InvalidArgumentError("usage: stall A B MS (MS a non-negative number)");
    }
    RETURN_IF_ERROR(Stall(words[1], words[2], MillisToDuration(ms)));
    return std::string();
  }
  if (verb == "set") {
    if (words.size() < 4) {
      return absl::InvalidArgumentError("usage: set A B [latency_ms=X] [bandwidth_mbps=Y] [jitter_ms=Z]");
    }
    ASSIGN_OR_RETURN(auto pair, RunOnLoop([&] { return FindLink(words[1], words[2]); }));
    LinkParams params = RunOnLoop([&] { return pair.first->params; });
    for (size_t i = 3; i < words.size(); ++i) {
      std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
      double value = 0;
      // Any number parses; SetLinkParams (ValidateLinkFigures) says which range a figure must be in.
      if (!absl::SimpleAtod(kv.second, &value)) {
        return absl::InvalidArgumentError(absl::StrCat("set: '", words[i], "' is not key=value with a number"));
      }
      if (kv.first == "latency_ms") {
        params.latency_ms = value;
      } else if (kv.first == "bandwidth_mbps") {
        params.bandwidth_mbps = value;
      } else if (kv.first == "jitter_ms") {
        params.jitter_ms = value;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("set: unknown key '", kv.first, "'; known keys: latency_ms, bandwidth_mbps, jitter_ms"));
      }
    }
    RETURN_IF_ERROR(SetLinkParams(words[1], words[2], params, /*both=*/true));
    return std::string();
  }
  if (verb == "stats") {
    if (words.size() == 2 && words[1] == "json") return FormatStatsJson(Stats());
    if (words.size() != 1) return absl::InvalidArgumentError("usage: stats [json]");
    return FormatStatsText(Stats());
  }
  if (verb == "routes") {
    std::string out;
    for (const RouteStatus& r : Routes()) {
      absl::StrAppend(&out, FormatRoute(r.spec), " listening ", options_.listen_host, ":", r.bound_port, "\n");
    }
    return out;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown command '", verb, "'; send 'help' for the list"));
}

absl::StatusOr<std::unique_ptr<Emulator>> Emulator::Create(const Topology& topology, std::vector<RouteSpec> routes,
                                                           EmulatorOptions options) {
  std::set<std::string> sites;
  for (const TopologySite& site : topology.sites()) sites.insert(site.name());
  std::set<std::pair<std::string, std::string>> links;
  for (const TopologyLink& link : topology.links()) {
    if (!sites.count(link.a()) || !sites.count(link.b()) || link.a() == link.b()) {
      return absl::InvalidArgumentError(absl::StrCat("topology link ", link.a(), "-", link.b(),
                                                     " is not between two known sites; load the "
                                                     "topology with LoadTopologyFile, which validates it"));
    }
    RETURN_IF_ERROR(ValidateLinkFigures(absl::StrCat("topology: link ", link.a(), "-", link.b()), link.latency_ms(),
                                        link.bandwidth_mbps(), link.jitter_ms()));
    links.insert(std::minmax(link.a(), link.b()));
  }
  if (routes.empty()) {
    return absl::InvalidArgumentError(
        "no routes: give at least one --route LISTEN_PORT=SRC_SITE>DST_SITE@TARGET_HOST:PORT "
        "(or a --routes-file)");
  }
  std::set<int> ports;
  for (const RouteSpec& route : routes) {
    const std::string text = FormatRoute(route);
    for (const std::string& site : {route.src_site, route.dst_site}) {
      if (!sites.count(site)) {
        return absl::InvalidArgumentError(absl::StrCat("route ", text, ": unknown site '", site,
                                                       "'; sites in the topology: ", absl::StrJoin(sites, ", ")));
      }
    }
    if (route.src_site == route.dst_site) {
      return absl::InvalidArgumentError(
          absl::StrCat("route ", text, ": both ends are in site '", route.src_site,
                       "'; traffic inside a site does not cross the emulator, connect to the target directly"));
    }
    if (!links.count(std::minmax(route.src_site, route.dst_site))) {
      return absl::InvalidArgumentError(absl::StrCat("route ", text, ": no link between '", route.src_site, "' and '",
                                                     route.dst_site, "' in the topology; add {a: ", route.src_site,
                                                     ", b: ", route.dst_site,
                                                     ", latency_ms: ..., bandwidth_mbps: ...} under 'links'"));
    }
    if (route.listen_port < 0 || route.listen_port > 65535 || route.target_port <= 0 || route.target_port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("route ", text, ": port out of range"));
    }
    if (route.listen_port != 0 && !ports.insert(route.listen_port).second) {
      return absl::InvalidArgumentError(absl::StrCat("route ", text, ": listen port ", route.listen_port,
                                                     " is used by another route; give each route its own listen port"));
    }
  }
  return std::unique_ptr<Emulator>(
      new Emulator(std::make_unique<Impl>(topology, std::move(routes), std::move(options))));
}

Emulator::Emulator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Emulator::~Emulator() { Stop(); }
absl::Status Emulator::Start() { return impl_->Start(); }
absl::StatusOr<int> Emulator::StartControlServer(int port) { return impl_->StartControlServer(port); }
void Emulator::Stop() { impl_->Stop(); }
std::vector<RouteStatus> Emulator::Routes() const { return impl_->Routes(); }
std::vector<LinkDirectionStats> Emulator::Stats() { return impl_->Stats(); }
absl::Status Emulator::SetLinkUp(std::string_view a, std::string_view b, bool up) { return impl_->SetLinkUp(a, b, up); }
absl::Status Emulator::Stall(std::string_view a, std::string_view b, Duration duration) {
  return impl_->Stall(a, b, duration);
}
absl::Status Emulator::SetLinkParams(std::string_view src, std::string_view dst, const LinkParams& params,
                                     bool both_directions) {
  return impl_->SetLinkParams(src, dst, params, both_directions);
}
absl::StatusOr<std::string> Emulator::ExecuteCommand(std::string_view line) { return impl_->ExecuteCommand(line); }

}  // namespace geotrain::netem
