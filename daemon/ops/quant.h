/* The quantized collectives (quant.c; plan options ,qw ,qg ,ef; the codecs are sd/codec.h):
 * their buffers, and what fetch and push call. */
#ifndef SD_QUANT_H
#define SD_QUANT_H

#include "net.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_job;
struct sd_config;

/* receive slots of ,qw gathers across nodes: one per gather in flight, and one to spare */
#define SD_QUANT_RX_SLOTS (SD_MAX_GATHERS_INFLIGHT + 1)

/* Bytes of the job's quantization buffers on this node (0 without a quantized option), for the
 * budget; sd_quant_alloc allocates exactly these. */
uint64_t sd_quant_bytes(const struct sd_job *job, const struct sd_config *cfg);
/* Lay out and allocate them (any thread: touches only job->mem.quant). */
int sd_quant_alloc(struct sd_job *job, char *err, size_t errlen);
/* On the loop, once allocated: the error-feedback residuals start at zero. */
void sd_quant_start(struct sd_job *job);
void sd_quant_free(struct sd_job *job);
/* the job goes: its state too (sd_quant_free keeps it, emptied, until then) */
void sd_quant_destroy(struct sd_job *job);
/* do gathers receive int8 blocks into receive slots (,qw across nodes)? */
bool sd_qw_rx_enabled(const struct sd_job *job);
/* the one allocation every quantized buffer lies in, for the fabric's registration (NULL: none) */
struct sd_mem;
const struct sd_mem *sd_quant_mem(const struct sd_job *job);

/* ---- ,qw */
/* encoded bytes of one w shard of unit u */
uint64_t sd_qw_shard_bytes(const struct sd_job *job, uint32_t u);
/* local rank local's w shard of unit u as int8 blocks, of the current weights generation:
 * quantized on the job's queue the first time it is asked for in a generation (*fresh_p set
 * then; the network may read it only after a sync). */
uint8_t *sd_qw_shard(struct sd_job *job, uint32_t local, uint32_t u, bool *fresh_p);
/* Is a receive slot free (or none needed: no ,qw gathers across nodes)? */
bool sd_qw_rx_available(const struct sd_job *job);
/* A receive slot for a gather, or -1 when all are taken. */
int32_t sd_qw_rx_take(struct sd_job *job);
void sd_qw_rx_put(struct sd_job *job, int32_t i);
/* Slot i is freed once the job's queue reached ticket (the decodes that read it): the loop's
 * poll (sd_qw_rx_poll: true if it freed any) frees it; waiting: whether any slot waits so. */
void sd_qw_rx_put_after(struct sd_job *job, int32_t i, uint64_t ticket);
bool sd_qw_rx_waiting(const struct sd_job *job);
bool sd_qw_rx_poll(struct sd_job *job);
uint8_t *sd_qw_rx(struct sd_job *job, int32_t i);
/* Can a batch of encoded remote bytes q be received in one slot? */
bool sd_qw_rx_fits(const struct sd_job *job, uint64_t q);
/* encoded bytes a gather of unit u receives from the other nodes */
uint64_t sd_qw_remote_bytes(const struct sd_job *job, uint32_t u);

/* ---- ,qg and ,gwire */
/* How the reduce-scatter of unit u across nodes moves its blocks (sd/codec.h): SD_CODEC_INT4
 * (,qg; not below quant_min_bytes, a fallback the caller counts), the plan's gradient wire
 * codec (,gwire=bf16 or fp16), or 0: fp32, exact */
int sd_qg_codec(const struct sd_job *job, uint32_t u);
/* node round r's buffers: the encoding of the block sent to the o-th other node, and the one
 * received from it */
uint8_t *sd_qg_send(struct sd_job *job, uint32_t r, uint32_t o);
uint8_t *sd_qg_recv(struct sd_job *job, uint32_t r, uint32_t o);
/* unit u's error-feedback residual of its block i (fp32, numel / G) */
float *sd_qg_ef(struct sd_job *job, uint32_t u, uint32_t i);
/* The boundary hop (the 2-hop sync's all-reduce of each node's g block among the R nodes
 * holding its replicas, count floats of unit u): its codec, as sd_qg_codec's (int4 not below
 * quant_min_bytes a member's segment). Its buffer, and unit u's error-feedback residual (NULL
 * without ,ef). */
uint32_t sd_qg_hop_nodes(const struct sd_job *job);
uint64_t sd_qg_hop_count(const struct sd_job *job, uint32_t u);
int sd_qg_hop_codec(const struct sd_job *job, uint32_t u);
uint8_t *sd_qg_hop_buf(struct sd_job *job);
float *sd_qg_hop_ef(struct sd_job *job, uint32_t u);

/* ---- ,qw after the optimizer (weights.c) */
/* encoded bytes of one os part of unit u (numel / f_os elements) */
uint64_t sd_qw_part_bytes(const struct sd_job *job, uint32_t u);
/* slot i < k: local rank i's os part encoded for the other nodes; slot k + j: the j-th part
 * received */
uint8_t *sd_qw_wx(struct sd_job *job, uint32_t i);

#endif
