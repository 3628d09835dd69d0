/* libFuzzer: bytes as they arrive on the client socket. The daemon's side of a frame, without a
 * daemon: the length check, the protobuf decode of a ClientMsg, and for a Register the
 * conversion into a model with every check registration makes (names, dims, units, dtypes,
 * hyperparameters, plan, layout). Nothing may crash, leak, or take time beyond O(n log n) in the
 * message's size. */
#include "sd/frame.h"
#include "sd/model.h"
#include "sd/model_msg.h"
#include "shard.pb-c.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* frames back to back, as conn_read splits them */
    while (size >= SD_FRAME_HDR) {
        size_t len = sd_frame_len(data);
        if (len > (1u << 20) || len > size - SD_FRAME_HDR)
            return 0;
        Shard__ClientMsg *m = shard__client_msg__unpack(NULL, len, data + SD_FRAME_HDR);
        if (m != NULL && m->msg_case == SHARD__CLIENT_MSG__MSG_REGISTER) {
            struct sd_model model;
            char err[512];
            if (sd_model_from_register(m->register_, 65536, 16384, &model, err, sizeof(err)) == 0) {
                struct sd_topo topo = {.nodes = 1 + m->register_->world % 4,
                                       .ranks_per_node = 1 + m->register_->rank % 8,
                                       .package_size = 1};
                struct sd_plan plan;
                struct sd_layout layout;
                if (sd_plan_parse(model.plan, &topo, &plan, err, sizeof(err)) == 0 &&
                    sd_layout_build(&model, &plan, &layout, err, sizeof(err)) == 0)
                    sd_layout_free(&layout);
                sd_model_free(&model);
            }
        }
        if (m != NULL)
            shard__client_msg__free_unpacked(m, NULL);
        data += SD_FRAME_HDR + len;
        size -= SD_FRAME_HDR + len;
    }
    return 0;
}
