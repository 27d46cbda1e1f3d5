#!/usr/bin/env python
"""Fine-tune a converted SCE trunk with detectron2 (Mask R-CNN R50-C4 on COCO, Faster R-CNN on VOC).

    python detection/train_net.py --config-file detection/configs/coco_R_50_C4_2x.yaml \
        --num-gpus 8 MODEL.WEIGHTS sce_r50.pkl

Takes detectron2's standard flags (--eval-only, --resume, --num-machines, ...) and config
overrides as trailing KEY VALUE pairs. See detection/README.md.
"""
import os
import sys

try:
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import get_cfg
    from detectron2.engine import DefaultTrainer, default_argument_parser, default_setup, launch
    from detectron2.evaluation import COCOEvaluator, PascalVOCDetectionEvaluator
    from detectron2.layers import get_norm
    from detectron2.modeling.roi_heads import ROI_HEADS_REGISTRY, Res5ROIHeads
except ImportError as e:
    sys.exit(f"error: detectron2 is needed ({e}): build it from source as detection/README.md says")


@ROI_HEADS_REGISTRY.register()
class Res5ROIHeadsExtraNorm(Res5ROIHeads):
    """Res5 ROI head with a norm layer (cfg.MODEL.RESNETS.NORM) after the last res5 block.

    Self-supervised features can be scaled unlike supervised ones (MoCo, sec. 4.2): normalizing
    the res5 output gives the newly initialized box and mask predictors a well-scaled input.
    """

    def __init__(self, cfg, input_shape):
        super().__init__(cfg, input_shape)
        self.res5.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, self.res5[-1].out_channels))


class Trainer(DefaultTrainer):
    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        output_folder = output_folder or os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        if "voc" in dataset_name:
            return PascalVOCDetectionEvaluator(dataset_name)
        if "coco" in dataset_name:
            return COCOEvaluator(dataset_name, output_dir=output_folder)
        raise ValueError(f"no evaluator for dataset {dataset_name}: name COCO or VOC datasets")


def setup(args):
    cfg = get_cfg()
    cfg.merge_from_file(args.config_file)
    cfg.merge_from_list(args.opts)
    cfg.freeze()
    default_setup(cfg, args)
    return cfg


def main(args):
    cfg = setup(args)
    if args.eval_only:
        model = Trainer.build_model(cfg)
        DetectionCheckpointer(model, save_dir=cfg.OUTPUT_DIR).resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)
        return Trainer.test(cfg, model)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()


if __name__ == "__main__":
    args = default_argument_parser().parse_args()
    print("Command line arguments:", args)
    launch(main, args.num_gpus, num_machines=args.num_machines, machine_rank=args.machine_rank,
           dist_url=args.dist_url, args=(args,))
