// Fuzzes the receiving side of a tensor stream: comm/tensor_chunks.h's TensorChunkAssembler, which the worker's
// TensorStream reactor runs on every message a peer sends, here without gRPC and with a fake sink in place of the
// server's mailbox. The input is one stream: a control byte, then messages, each a 2-byte little-endian length
// and that many bytes (a serialized TensorChunk), each handed over in two pieces split where its first byte says
// (gRPC delivers a message as several slices). The stream stops at the first error, as the server ends the call.
// The control byte picks the sink's behaviour:
//   bit 0   a receiver (RecvInto) is waiting for every tensor: element-wise codecs are decoded chunk by chunk into
//           its buffer (the decode-on-arrival path), the others go to the mailbox;
//   bits 1-3  that receiver gives up before write number N (1..7; 0: never): BeginWrite fails from then on;
//   bit 4   the sink refuses reservations (a peer over its budget);
//   bit 5   the sink refuses deliveries (a key already waiting).
// Checked: nothing is allocated before the reservation and reservations are given back exactly once (none is
// left when the stream ends); writes into the receiver's buffer happen only inside BeginWrite/EndWrite and
// stay inside it (ASan); a claim ends exactly once; a delivered tensor has the size its header gave, a codec
// header and payload CRC that verify, its shape's element count, and decodes (or fails cleanly); a fp16 or bf16
// tensor decoded on arrival wrote every element of the buffer.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/codec.h"
#include "comm/tensor_chunks.h"
#include "fuzz/fuzz_util.h"

namespace {

using geotrain::comm::ReceivedTensor;
using geotrain::comm::TensorDestination;
using geotrain::comm::TensorKey;

// Bits no fp16 or bf16 decode produces (their low 13 bits are zero), so a survivor is an element never written.
constexpr uint32_t kUnwritten = 0x7FC01234u;
constexpr uint64_t kMaxWaitingElements = uint64_t{1} << 18;

class FakeSink : public geotrain::comm::TensorSink {
 public:
  FakeSink(uint8_t control, uint64_t max_tensor_bytes)
      : waiting_(control & 1),
        give_up_at_write_((control >> 1) & 7),
        refuse_reserve_(control & 16),
        refuse_deliver_(control & 32),
        max_tensor_bytes_(max_tensor_bytes) {}

  absl::Status Reserve(const TensorKey&, uint64_t bytes) override {
    FUZZ_CHECK(bytes <= max_tensor_bytes_, "reservations within max_tensor_bytes");
    FUZZ_CHECK(reserved_ == 0, "one reservation at a time on a stream");
    if (refuse_reserve_) return absl::ResourceExhaustedError("over budget");
    reserved_ = bytes;
    return absl::OkStatus();
  }
  void Release(const TensorKey&, uint64_t bytes) override {
    FUZZ_CHECK(bytes == reserved_ && bytes > 0, "a release gives back the reservation");
    reserved_ = 0;
  }
  absl::Status Deliver(ReceivedTensor tensor) override {
    FUZZ_CHECK(tensor.encoded.size() == reserved_, "a tensor is as large as its reservation");
    reserved_ = 0;
    absl::StatusOr<geotrain::comm::EncodedInfo> info =
        geotrain::comm::InspectEncoded(tensor.encoded.span(), /*verify_checksum=*/true);
    FUZZ_CHECK(info.ok(), "a delivered tensor has a valid codec header and payload CRC");
    FUZZ_CHECK(static_cast<int64_t>(info->element_count) == tensor.num_elements(), "element count = shape product");
    if (info->element_count <= (1u << 20)) {
      std::vector<float> out(info->element_count);
      (void)tensor.DecodeInto(absl::MakeSpan(out));
    }
    if (refuse_deliver_) return absl::AlreadyExistsError("already waiting");
    return absl::OkStatus();
  }
  std::shared_ptr<TensorDestination> Claim(const TensorKey&, uint64_t elements) override {
    FUZZ_CHECK(destination_ == nullptr, "one claim at a time on a stream");
    if (!waiting_ || elements > kMaxWaitingElements) return nullptr;
    // An exact-size heap buffer, so that ASan sees a write past it.
    buffer_ = std::make_unique<float[]>(elements);
    for (uint64_t i = 0; i < elements; ++i) std::memcpy(&buffer_[i], &kUnwritten, 4);
    destination_ = std::make_shared<TensorDestination>();
    destination_->out = absl::MakeSpan(buffer_.get(), elements);
    destination_->claimed = true;
    return destination_;
  }
  absl::Status BeginWrite(TensorDestination* d, const TensorKey&) override {
    FUZZ_CHECK(d == destination_.get() && d->claimed && !d->writing, "writes into a claimed buffer, one at a time");
    if (give_up_at_write_ != 0 && ++writes_ >= give_up_at_write_) d->withdrawn = true;
    if (d->withdrawn) return absl::DeadlineExceededError("the receiver stopped waiting");
    d->writing = true;
    return absl::OkStatus();
  }
  void EndWrite(TensorDestination* d) override {
    FUZZ_CHECK(d == destination_.get() && d->writing, "EndWrite follows BeginWrite");
    d->writing = false;
  }
  absl::Status CompleteClaim(TensorDestination* d, const TensorKey&, uint64_t bytes) override {
    FUZZ_CHECK(d == destination_.get() && d->claimed && !d->writing, "a claim completes once, after its writes");
    FUZZ_CHECK(bytes <= max_tensor_bytes_, "a tensor within max_tensor_bytes");
    const uint64_t n = d->out.size();
    FUZZ_CHECK(bytes == geotrain::comm::kCodecHeaderBytes + 2 * n || bytes == geotrain::comm::kCodecHeaderBytes + 4 * n,
               "decoded on arrival: a none, fp16 or bf16 tensor of the buffer's element count");
    if (bytes == geotrain::comm::kCodecHeaderBytes + 2 * n && n > 0) {  // fp16 or bf16
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &d->out[i], 4);
        FUZZ_CHECK(bits != kUnwritten, "every element of the receiver's buffer was written");
      }
    }
    d->claimed = false;
    d->done = true;
    destination_.reset();
    return absl::OkStatus();
  }
  void Unclaim(TensorDestination* d) override {
    FUZZ_CHECK(d == destination_.get() && d->claimed, "an unclaim ends a claim");
    d->claimed = false;
    d->writing = false;
    destination_.reset();
  }

  bool holds_nothing() const { return reserved_ == 0 && destination_ == nullptr; }

 private:
  const bool waiting_;
  const int give_up_at_write_;
  const bool refuse_reserve_;
  const bool refuse_deliver_;
  const uint64_t max_tensor_bytes_;
  uint64_t reserved_ = 0;
  int writes_ = 0;
  std::shared_ptr<TensorDestination> destination_;
  std::unique_ptr<float[]> buffer_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  geotrain::comm::TensorStreamOptions options;
  options.max_tensor_bytes = 1 << 20;
  options.max_chunk_bytes = 64 << 10;
  FakeSink sink(data[0], options.max_tensor_bytes);
  {
    geotrain::comm::TensorChunkAssembler assembler(options, &sink);
    size_t at = 1;
    while (at + 2 <= size) {
      const size_t length = std::min<size_t>(data[at] | (size_t{data[at + 1]} << 8), size - at - 2);
      const uint8_t* message = data + at + 2;
      at += 2 + length;
      const size_t split = length == 0 ? 0 : message[0] % (length + 1);
      const absl::Span<const uint8_t> pieces[2] = {{message, split}, {message + split, length - split}};
      absl::StatusOr<bool> delivered = assembler.AddChunk(pieces);
      if (!delivered.ok()) {
        assembler.Abandon();
        FUZZ_CHECK(sink.holds_nothing(), "an abandoned tensor gives back its reservation and its claim");
        break;
      }
      if (*delivered) {
        FUZZ_CHECK(sink.holds_nothing(), "a delivered tensor holds nothing more");
        FUZZ_CHECK(assembler.delivered_bytes() <= options.max_tensor_bytes, "delivered size within the limit");
      }
    }
  }
  FUZZ_CHECK(sink.holds_nothing(), "nothing is held once the stream ends");
  return 0;
}
